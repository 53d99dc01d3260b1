"""Tokenizers for every model source.

- Hugging Face folder: tokenizer.json plus tokenizer_config.json (chat template, bos/eos, add_bos_token), on the
  `tokenizers` library.
- GGUF: rebuilt from tokenizer.ggml.* metadata; "gpt2" byte-level BPE (the `tokenizers` library, with the file's
  merges and the pre-tokenizer named by tokenizer.ggml.pre: SmolLM2's "smollm" splits digits one by one), or
  "llama" SentencePiece BPE (text/sentencepiece_bpe.py: from the pieces' scores, no merges table).
- Random weights of a named shape: a byte-level tokenizer (256 byte tokens plus ChatML specials) that
  fits inside the shape's vocab, so the tiny test model round-trips any text.
"""
from __future__ import annotations

import json
import logging
import os
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from stallfree.node_daemon.text.chat_template import render_chat
from stallfree.node_daemon.text.sentencepiece_bpe import SentencePieceBPE

log = logging.getLogger(__name__)

CHATML_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
_PAIR_ALPHABET = " etaoinsrhldcumfpgwybvkxjqz"

# Pre-tokenizer split patterns by GGUF tokenizer.ggml.pre (the same regexes llama.cpp uses).
_GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
_LLAMA3_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
_QWEN2_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
_DIGITS_THEN_GPT2 = {"smollm", "starcoder", "refact", "codeshell", "exaone", "minerva", "command-r"}
_LLAMA3_LIKE = {"llama-bpe", "llama3", "llama-v3", "smaug-bpe", "dbrx"}
_QWEN2_LIKE = {"qwen2", "deepseek-r1-qwen"}
_GPT2_LIKE = {"gpt-2", "gpt2", "default", "olmo", "jais", "phi-2"}

_END_OF_GENERATION = {"<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>", "</s>"}

# GGUF token types (llama.cpp's llama_token_type).
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4


@dataclass
class Tokenizer:
    """Encode, decode and chat-format for one model. Thread-safe: neither backend changes after it is built."""

    backend: HFTokenizer | SentencePieceBPE
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    add_bos_token: bool
    chat_template: str | None
    bos_token: str = ""
    eos_token: str = ""
    source: str = ""
    # The longest piece's length in characters, where the source lists its pieces (a GGUF file): what
    # daemon.max_chars_per_token would otherwise read from a 262k-entry dict built for it (0.2 s of a start).
    longest_piece_chars: int | None = None

    @property
    def vocab_size(self) -> int:
        if isinstance(self.backend, SentencePieceBPE):
            return len(self.backend.tokens)
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def normalizes(self) -> bool:
        """Whether text is rewritten before it is split (then one token's text may differ in length from its piece)."""
        return isinstance(self.backend, SentencePieceBPE) or self.backend.normalizer is not None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; a BOS is added when the model wants one and the text has none yet.

        Rendered chat templates often start with the BOS text already, so it is never doubled.
        """
        if isinstance(self.backend, SentencePieceBPE):
            ids = self.backend.encode(text)
        else:
            # encode_batch releases the GIL (encode holds it): a huge prompt tokenizing on a worker thread
            # does not stall the event loop or the engine thread.
            ids = self.backend.encode_batch([text], add_special_tokens=False)[0].ids
        if (add_special_tokens and self.add_bos_token and self.bos_token_id is not None
                and not (ids and ids[0] == self.bos_token_id)):
            ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        if isinstance(self.backend, SentencePieceBPE):
            return self.backend.vocab.get(token)
        return self.backend.token_to_id(token)

    def special_tokens(self) -> dict[str, int]:
        """The special (control) tokens' texts and ids."""
        if isinstance(self.backend, SentencePieceBPE):
            return {added.content: i for i, added in self.backend.added.items() if added.special}
        return {added.content: i for i, added in self.backend.get_added_tokens_decoder().items() if added.special}

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **extra: Any) -> str:
        """Render OpenAI-style messages into the prompt text (ChatML when the model has no template)."""
        return render_chat(self.chat_template, messages, add_generation_prompt=add_generation_prompt,
                           bos_token=self.bos_token, eos_token=self.eos_token, **extra)


# ---------------------------------------------------------------- entry point


def load_tokenizer(source: Any, vocab_size: int | None = None) -> Tokenizer:
    """A tokenizer for a LoadedModel, a model folder, a .gguf file, a ModelShape or a shape name.

    A LoadedModel is asked for its `source` (path) first; a source that is no file or folder falls back
    to the byte-level tokenizer sized to the model's vocab (random weights).
    """
    shape = getattr(source, "shape", None)
    if shape is not None and hasattr(source, "source"):  # a LoadedModel
        path = getattr(source, "source", None)
        if getattr(source, "tokenizer_metadata", None):  # a GGUF file's, read with its weights
            return from_gguf_metadata(source.tokenizer_metadata, str(path))
        if path and Path(str(path)).exists():
            return load_tokenizer(str(path))
        return byte_level_tokenizer(shape.vocab_size)
    if hasattr(source, "vocab_size") and hasattr(source, "hidden_size"):  # a ModelShape
        return byte_level_tokenizer(source.vocab_size)
    text = os.fspath(source)
    path = Path(text)
    if path.is_dir():
        return from_hf_folder(path)
    if path.is_file() and path.suffix == ".gguf":
        return from_gguf(path)
    if vocab_size is not None:
        return byte_level_tokenizer(vocab_size)
    from stallfree.shapes import SHAPES

    if text.lower() in SHAPES:
        return byte_level_tokenizer(SHAPES[text.lower()].vocab_size)
    raise ValueError(f"no tokenizer for {text!r}: expected a model folder, a .gguf file or a shape name")


# ---------------------------------------------------------------- byte-level (random weights)


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (ByteLevel pre-tokenizer's alphabet)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return dict(zip(printable, map(chr, chars)))


def byte_level_tokenizer(vocab_size: int) -> Tokenizer:
    """Bytes 0..255 are ids 0..255, then <|endoftext|>, <|im_start|>, <|im_end|>, then two-letter tokens.

    The two-letter tokens (pairs over space and the lowercase letters, with their merges) fill the
    rest of a small vocab, so a random-weight model's output reads as text rather than mostly nothing;
    any text still round-trips exactly. Ids past the table (large vocabs) decode to nothing.
    """
    need = 256 + len(CHATML_SPECIALS)
    if vocab_size < need:
        raise ValueError(f"a byte-level tokenizer needs a vocab of at least {need}, the model has {vocab_size}")
    byte_chars = bytes_to_unicode()
    vocab = {ch: b for b, ch in byte_chars.items()}
    vocab.update({t: 256 + i for i, t in enumerate(CHATML_SPECIALS)})
    letters = [byte_chars[b] for b in _PAIR_ALPHABET.encode()]
    pairs = [(a, b) for a in letters for b in letters][: vocab_size - need]
    for i, (a, b) in enumerate(pairs):
        vocab[a + b] = need + i
    backend = HFTokenizer(models.BPE(vocab=vocab, merges=pairs))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    # The specials are in the vocab already (ids 256..258); this marks them special (never split, skippable).
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in CHATML_SPECIALS])
    endoftext, _, im_end = (backend.token_to_id(t) for t in CHATML_SPECIALS)
    return Tokenizer(backend, eos_token_ids=(im_end, endoftext), bos_token_id=None, add_bos_token=False,
                     chat_template=None, eos_token="<|im_end|>", source=f"byte-level/{vocab_size}")


# ---------------------------------------------------------------- Hugging Face folder


def _token_text(value: Any) -> str:
    if isinstance(value, dict):
        return str(value.get("content", ""))
    return value or ""


def _pick_template(value: Any) -> str | None:
    if isinstance(value, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        by_name = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        return by_name.get("default") or next(iter(by_name.values()), None)
    return value or None


def from_hf_folder(folder: str | Path) -> Tokenizer:
    folder = Path(folder)
    tokenizer_file = folder / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise ValueError(f"{folder} has no tokenizer.json (only fast tokenizers are supported)")
    backend = HFTokenizer.from_file(str(tokenizer_file))
    config = _read_json(folder / "tokenizer_config.json")
    template = _pick_template(config.get("chat_template"))
    if template is None and (folder / "chat_template.jinja").is_file():
        template = (folder / "chat_template.jinja").read_text()
    bos_token = _token_text(config.get("bos_token"))
    eos_token = _token_text(config.get("eos_token"))
    bos_id = backend.token_to_id(bos_token) if bos_token else None
    eos_ids: list[int] = []
    for name in ("generation_config.json", "config.json"):
        value = _read_json(folder / name).get("eos_token_id")
        eos_ids += value if isinstance(value, list) else ([value] if isinstance(value, int) else [])
    if eos_token and backend.token_to_id(eos_token) is not None:
        eos_ids.append(backend.token_to_id(eos_token))
    # Llama-style tokenizer.json post-processors add BOS themselves; encode() adds it explicitly instead.
    add_bos = bool(config.get("add_bos_token", _post_processor_adds_bos(backend, bos_id)))
    return Tokenizer(backend, eos_token_ids=tuple(dict.fromkeys(eos_ids)), bos_token_id=bos_id,
                     add_bos_token=add_bos and bos_id is not None, chat_template=template,
                     bos_token=bos_token, eos_token=eos_token, source=str(folder))


def _post_processor_adds_bos(backend: HFTokenizer, bos_id: int | None) -> bool:
    if bos_id is None:
        return False
    ids = backend.encode("a", add_special_tokens=True).ids
    return bool(ids) and ids[0] == bos_id


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    return data if isinstance(data, dict) else {}


# ---------------------------------------------------------------- GGUF


def gguf_tokenizer_metadata(reader) -> dict[str, Any]:
    """Every tokenizer.* field of an open gguf.GGUFReader, decoded (vocabulary, merges, scores, types, ids).
    The model loader calls it on the reader it loads the weights from, so the file is parsed once."""
    return {key: field.contents() for key, field in reader.fields.items() if key.startswith("tokenizer.")}


def from_gguf(path: str | Path) -> Tokenizer:
    import gguf

    return from_gguf_metadata(gguf_tokenizer_metadata(gguf.GGUFReader(str(path))), str(path))


_started: dict[str, tuple[Future, Future]] = {}  # GGUF path -> (the tokenizer, its tokenizer.* metadata)


def start_from_gguf(path: str) -> None:
    """Build this GGUF file's tokenizer on a thread once the loader has parsed the header, while the weights
    decode (their kernels release the GIL): Gemma 3's 262k pieces take 0.1 s. The loader hands over the header
    it parsed (gave_metadata); the next from_gguf_metadata() for this file takes the result. Call it only where
    that call follows (the daemon)."""
    key = os.path.abspath(path)
    if key in _started or not os.path.isfile(path):
        return
    tokenizer: Future = Future()
    metadata: Future = Future()
    _started[key] = (tokenizer, metadata)

    def build() -> None:
        try:
            # The loader's header. A load that fails before giving it leaves this daemon thread waiting (no one
            # asks for the tokenizer then) until the timeout.
            meta = metadata.result(timeout=600)
            tokenizer.set_result(_from_gguf_metadata(meta, path))
        except BaseException as exc:  # noqa: BLE001 - handed to from_gguf_metadata, which builds again
            tokenizer.set_exception(exc)

    threading.Thread(target=build, name="tokenizer-build", daemon=True).start()


def gave_metadata(path: str, meta: dict[str, Any]) -> None:
    """The loader's tokenizer.* fields of a file whose tokenizer start_from_gguf() is building."""
    started = _started.get(os.path.abspath(path))
    if started is not None and not started[1].done():
        started[1].set_result(meta)


def from_gguf_metadata(meta: dict[str, Any], path: str) -> Tokenizer:
    """The tokenizer a GGUF file's tokenizer.* metadata describes (`path` names the file in errors); the one
    start_from_gguf() began for this file, when it did."""
    gave_metadata(path, meta)
    started = _started.pop(os.path.abspath(path), None)
    if started is not None:
        try:
            return started[0].result()
        except Exception as exc:  # noqa: BLE001 - built again here, where its error (if any) is raised
            log.warning("tokenizer built beside the weights failed (%s): building it again", exc)
    return _from_gguf_metadata(meta, path)


def _from_gguf_metadata(meta: dict[str, Any], path: str) -> Tokenizer:
    kind = meta.get("tokenizer.ggml.model")
    tokens: list[str] = meta.get("tokenizer.ggml.tokens") or []
    if not tokens:
        raise ValueError(f"{path} carries no tokenizer (tokenizer.ggml.tokens is missing)")
    types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if kind not in ("gpt2", "llama"):
        raise ValueError(f"{path}: GGUF tokenizer model {kind!r} is not supported (gpt2 and llama are)")
    add_bos_default = kind == "llama"

    backend: HFTokenizer | SentencePieceBPE
    if kind == "gpt2":
        backend = _gguf_byte_level_bpe(tokens, meta.get("tokenizer.ggml.merges") or [],
                                       meta.get("tokenizer.ggml.pre", "default"))
        specials = [AddedToken(t, special=True, normalized=False)
                    for t, ty in zip(tokens, types) if ty == _TOKEN_TYPE_CONTROL]
        user = [AddedToken(t, special=False, normalized=False)
                for t, ty in zip(tokens, types) if ty == _TOKEN_TYPE_USER_DEFINED]
        backend.add_special_tokens(specials)
        if user:
            backend.add_tokens(user)
    else:  # its control and user-defined pieces are its added tokens, as they would be in the library
        backend = SentencePieceBPE(tokens, meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens), types,
                                   meta.get("tokenizer.ggml.add_space_prefix", True))
    bos_id = meta.get("tokenizer.ggml.bos_token_id")
    eos_id = meta.get("tokenizer.ggml.eos_token_id")
    eos_ids = [eos_id] if eos_id is not None else []
    for key in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        if meta.get(key) is not None:
            eos_ids.append(meta[key])
    # Like llama.cpp, control tokens that end a turn or a text also end generation.
    eos_ids += [i for i, (t, ty) in enumerate(zip(tokens, types)) if ty == _TOKEN_TYPE_CONTROL and t in _END_OF_GENERATION]
    return Tokenizer(
        backend,
        eos_token_ids=tuple(dict.fromkeys(int(i) for i in eos_ids)),
        bos_token_id=int(bos_id) if bos_id is not None else None,
        add_bos_token=bool(meta.get("tokenizer.ggml.add_bos_token", add_bos_default)) and bos_id is not None,
        chat_template=meta.get("tokenizer.chat_template") or None,
        bos_token=tokens[bos_id] if bos_id is not None and bos_id < len(tokens) else "",
        eos_token=tokens[eos_id] if eos_id is not None and eos_id < len(tokens) else "",
        source=str(path),
        longest_piece_chars=max(map(len, tokens)),
    )


def _byte_level_pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    if pre in _LLAMA3_LIKE or pre in _QWEN2_LIKE:
        pattern = _LLAMA3_PATTERN if pre in _LLAMA3_LIKE else _QWEN2_PATTERN
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    if pre in _DIGITS_THEN_GPT2:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
    if pre not in _GPT2_LIKE:
        log.warning("GGUF pre-tokenizer %r is not known here; splitting text with GPT-2's pattern", pre)
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _gguf_byte_level_bpe(tokens: list[str], merges: list[str], pre: str) -> HFTokenizer:
    vocab = {tok: i for i, tok in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    model = models.BPE(vocab=vocab, merges=pairs, ignore_merges=pre in _LLAMA3_LIKE)
    backend = HFTokenizer(model)
    backend.pre_tokenizer = _byte_level_pre_tokenizer(pre)
    backend.decoder = decoders.ByteLevel()
    return backend
