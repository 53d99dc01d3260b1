"""`stallfree bench agree`: stallfree's serving forward against llama.cpp's server, greedy tokens and top-5 logprobs.

For each GGUF file, a few fixed prompts given as token ids (no tokenizer on either side) run through stallfree's
ModelRunner in this process (the forward `stallfree serve` runs: prefill in chunks, then one decode per step) and
through llama.cpp's llama-server, started as a child on a free loopback port with `-m FILE --offline` (it never
downloads) and killed at the end, its log in a file. Both sides decode greedily; the command compares the tokens
and, at every position where both saw the same context, the logprobs of the tokens in both top-5 lists.

Exits 1 when any token differs or the worst logprob difference passes --tolerance (2e-3 suits float32 files;
quantized files need a looser one: llama.cpp quantizes activations to 8 bits in its quantized dot products, which
stallfree's float32 run does not). `--random qwen3,gemma3` writes tiny random float32 files of those families
(bench/write_random_gguf.py) into a temporary folder and checks them too.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import socket
import sys
import tempfile
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterator

from stallfree.bench import daemon_process
from stallfree.ready import ExitedBeforeReady, NotReadyInTime, wait_until_ready

STEPS = 8
MAX_STEPS = 256
PROMPT_LENGTHS = (12, 23, 34)  # token ids after the BOS
TOP_K = 5
PREFILL_CHUNK = 7  # prompts of 12-34 tokens: each prefill spans several chunks, as a busy server's would
BLOCK_SIZE = 16
F32_TOLERANCE = 2e-3
SERVER_START_TIMEOUT_S = 300.0
RANDOM_ARCHES = ("qwen3", "gemma3")


@dataclass
class Trace:
    """One prompt's greedy continuation: the tokens, and per step token id -> logprob of the TOP_K most likely."""
    tokens: list[int]
    top: list[dict[int, float]]


@dataclass
class PromptResult:
    prompt_tokens: int
    matched: int  # greedy tokens equal before the first difference
    steps: int
    worst: float  # the largest |logprob difference| over the positions with the same context
    stallfree: list[int]
    llama_cpp: list[int]
    # At the first different token: stallfree's logprob of its own pick minus that of llama.cpp's pick (None when
    # the latter is outside stallfree's top 5). Below the worst difference, the two picks were a near tie.
    tie_gap: float | None = None


@dataclass
class FileResult:
    path: str
    prompts: list[PromptResult] = field(default_factory=list)

    @property
    def matched(self) -> int:
        return sum(p.matched for p in self.prompts)

    @property
    def total(self) -> int:
        return sum(p.steps for p in self.prompts)

    @property
    def worst(self) -> float:
        return max((p.worst for p in self.prompts), default=0.0)

    def agrees(self, tolerance: float) -> bool:
        return self.matched == self.total and self.worst <= tolerance


def fixed_prompts(vocab_size: int, bos_token_id: int | None) -> list[list[int]]:
    """Three prompts of 12, 23 and 34 token ids spread over the vocabulary, after the model's BOS as its tokenizer
    would put it. The lowest ids are left out: vocabularies keep their special and unused tokens there (Gemma 3's
    6-105), whose embeddings were never trained."""
    low = min(1000, vocab_size // 4)
    span = min(40000, vocab_size - low)
    bos = [] if bos_token_id is None else [bos_token_id]
    return [bos + [(37 * j + 11 + 101 * k) % span + low for j in range(n)] for k, n in enumerate(PROMPT_LENGTHS)]


def compare_prompt(prompt_tokens: int, ours: Trace, theirs: Trace) -> PromptResult:
    matched = 0
    while matched < min(len(ours.tokens), len(theirs.tokens)) and ours.tokens[matched] == theirs.tokens[matched]:
        matched += 1
    worst = 0.0
    # Step n's distribution follows the same context on both sides while the tokens before it agree.
    for a, b in zip(ours.top[:matched + 1], theirs.top[:matched + 1]):
        worst = max([worst] + [abs(a[t] - b[t]) for t in a.keys() & b.keys()])
    tie_gap = None
    if matched < min(len(ours.tokens), len(theirs.tokens)):
        top = ours.top[matched]
        theirs_pick = theirs.tokens[matched]
        tie_gap = top[ours.tokens[matched]] - top[theirs_pick] if theirs_pick in top else None
    return PromptResult(prompt_tokens, matched, len(ours.tokens), worst, ours.tokens, theirs.tokens, tie_gap)


def compare(path: str, prompts: list[list[int]], ours: list[Trace], theirs: list[Trace]) -> FileResult:
    if len(ours) != len(theirs):
        raise ValueError(f"{len(ours)} stallfree traces against {len(theirs)} from llama.cpp")
    return FileResult(path, [compare_prompt(len(p), a, b) for p, a, b in zip(prompts, ours, theirs)])


# --- stallfree's side -------------------------------------------------------------------------------------------

@contextlib.contextmanager
def _weight_cache_off(off: bool) -> Iterator[None]:
    """Files in a temporary folder are loaded once: caching their tensors would only leave files behind."""
    from stallfree.node_daemon.models import weight_cache

    saved = os.environ.get(weight_cache.ENV)
    if off:
        os.environ[weight_cache.ENV] = "off"
    try:
        yield
    finally:
        if off:
            if saved is None:
                os.environ.pop(weight_cache.ENV, None)
            else:
                os.environ[weight_cache.ENV] = saved


def load_runner(path: str, dtype: str, threads: int | None, steps: int = STEPS, cache: bool = True):
    from stallfree.node_daemon.engine.config import CacheConfig
    from stallfree.node_daemon.engine.model_runner import ModelRunner
    from stallfree.node_daemon.models.config import ModelConfig

    # the longest prompt (and its BOS) with its continuation; one request at a time
    blocks = -(-(1 + max(PROMPT_LENGTHS) + steps) // BLOCK_SIZE)
    with _weight_cache_off(not cache):
        return ModelRunner(ModelConfig(model=path, dtype=dtype, threads=threads),
                           CacheConfig(block_size=BLOCK_SIZE, num_blocks=blocks), max_num_tokens=256, max_num_seqs=1)


def _top(logits) -> dict[int, float]:
    import torch

    values, ids = torch.log_softmax(logits.double(), -1).topk(TOP_K)
    return {int(i): float(v) for i, v in zip(ids, values)}


def stallfree_traces(runner, prompts: list[list[int]], steps: int = STEPS, chunk: int = PREFILL_CHUNK) -> list[Trace]:
    """Greedy continuations through runner.execute_model, as the engine drives it: chunked prefill, then decodes."""
    from stallfree.node_daemon.engine.request import Request
    from stallfree.node_daemon.engine.sampling_params import SamplingParams
    from stallfree.node_daemon.engine.scheduler_output import ScheduledChunk, SchedulerOutput

    def run(chunk: ScheduledChunk):
        logits = runner.execute_model(SchedulerOutput(chunks=[chunk]))
        return logits[0] if chunk.samples else None  # a chunk short of the prompt's end samples nothing

    traces = []
    for i, prompt in enumerate(prompts):
        req = Request(f"agree-{i}", list(prompt), SamplingParams(max_tokens=steps))
        req.block_ids = list(range(-(-(len(prompt) + steps) // runner.block_size)))
        for pos in range(0, len(prompt), chunk):
            n = min(chunk, len(prompt) - pos)
            logits = run(ScheduledChunk(req, pos, n, is_prefill=True, samples=pos + n == len(prompt)))
        req.num_computed_tokens = len(prompt)
        trace = Trace([], [])
        for _ in range(steps):
            trace.top.append(_top(logits))
            trace.tokens.append(int(logits.argmax()))
            req.append_output_token(trace.tokens[-1])
            logits = run(ScheduledChunk(req, req.num_tokens - 1, 1, is_prefill=False, samples=True))
            req.num_computed_tokens = req.num_tokens
        traces.append(trace)
    return traces


# --- llama.cpp's side -------------------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _answers_health(url: str) -> bool:
    """llama-server's GET /health: 503 while the model loads, 200 once it serves."""
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


@contextlib.contextmanager
def llama_server(binary: str, gguf: str, log_path: str, threads: int, extra: list[str] = ()) -> Iterator[str]:
    """llama-server on `gguf` as a child on a free loopback port; yields its URL once /health answers 200."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    process, log = daemon_process.start([binary, "-m", gguf, "--host", "127.0.0.1", "--port", str(port),
                                         "-t", str(threads), "-np", "1", "-c", "2048", "--no-webui", "--offline",
                                         *extra], log_path=Path(log_path))
    try:
        try:
            wait_until_ready(lambda: _answers_health(url), SERVER_START_TIMEOUT_S, poll_s=0.25,
                             alive=lambda: process.poll() is None, what=f"llama-server at {url}")
        except (ExitedBeforeReady, NotReadyInTime) as exc:
            raise RuntimeError(f"{exc}; the end of its log {log}:\n{daemon_process.log_tail(log)}") from None
        yield url
    finally:
        daemon_process.stop(process, timeout_s=10)


def llama_traces(url: str, prompts: list[list[int]], steps: int = STEPS, ignore_eos: bool = False) -> list[Trace]:
    """Greedy continuations from /completion: top_k 1 as the only sampler; n_probs gives the TOP_K logprobs of the
    distribution before sampling. ignore_eos: `steps` tokens even past an end of generation, as stallfree's traces."""
    traces = []
    for prompt in prompts:
        body = {"prompt": prompt, "n_predict": steps, "temperature": 0, "top_k": 1, "samplers": ["top_k"],
                "n_probs": TOP_K, "cache_prompt": False, "ignore_eos": ignore_eos}
        request = urllib.request.Request(f"{url}/completion", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=300) as r:
            probs = json.load(r)["completion_probabilities"]
        traces.append(Trace([p["id"] for p in probs],
                            [{t["id"]: t["logprob"] for t in p["top_logprobs"]} for p in probs]))
    return traces


# --- the command --------------------------------------------------------------------------------------------------

def write_random(arches: list[str], folder: str) -> list[str]:
    """Tiny random float32 files of these families, through `stallfree bench write-gguf --arch A --type f32`."""
    from stallfree.bench import write_random_gguf

    paths = []
    for arch in arches:
        path = os.path.join(folder, f"random-{arch}-f32.gguf")
        if write_random_gguf.main(["--arch", arch, "--type", "f32", "--out", path]) != 0:
            raise RuntimeError(f"writing the random {arch} file failed")
        paths.append(path)
    return paths


def check_file(path: str, args, log_dir: str, cache: bool) -> FileResult:
    runner = load_runner(path, args.dtype, args.threads, args.steps, cache)
    prompts = fixed_prompts(runner.loaded.shape.vocab_size, runner.loaded.bos_token_id)
    ours = stallfree_traces(runner, prompts, args.steps)
    del runner
    log_path = os.path.join(log_dir, f"llama-server-{os.path.basename(path)}.log")
    with llama_server(args.llama_server, path, log_path, args.threads, shlex.split(args.llama_args)) as url:
        theirs = llama_traces(url, prompts, args.steps)
    print(f"llama-server log: {log_path}")
    return compare(path, prompts, ours, theirs)


def print_table(result: FileResult, tolerance: float) -> None:
    print(f"\n{result.path}")
    print(f"  {'prompt':>6}  {'tokens matched':>14}  {'worst top-5 logprob diff':>24}")
    for p in result.prompts:
        print(f"  {p.prompt_tokens:>6}  {f'{p.matched}/{p.steps}':>14}  {p.worst:>24.2e}")
        if p.matched < p.steps:
            gap = "outside stallfree's top 5" if p.tie_gap is None else f"{p.tie_gap:.2e} below stallfree's"
            print(f"          first difference at step {p.matched}: llama.cpp's pick {gap}\n"
                  f"          stallfree {p.stallfree}\n          llama.cpp {p.llama_cpp}")
    verdict = "agree" if result.agrees(tolerance) else "DIFFER"
    print(f"  {'all':>6}  {f'{result.matched}/{result.total}':>14}  {result.worst:>24.2e}  {verdict} "
          f"(tolerance {tolerance:.1e})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="stallfree bench agree", description=__doc__.split("\n\n")[0])
    parser.add_argument("gguf", nargs="*", help="GGUF files to check")
    parser.add_argument("--llama-server", required=True, metavar="PATH", help="llama.cpp's llama-server binary")
    parser.add_argument("--random", default="", metavar="ARCHES",
                        help=f"also write and check tiny random float32 files of these families ({','.join(RANDOM_ARCHES)})")
    parser.add_argument("--tolerance", type=float, default=F32_TOLERANCE,
                        help="largest top-5 logprob difference that passes (default %(default)g, for float32 files)")
    parser.add_argument("--dtype", default="float32", help="stallfree's dtype (default %(default)s)")
    parser.add_argument("--steps", type=int, default=STEPS, help="greedy tokens per prompt (default %(default)s)")
    parser.add_argument("--threads", type=int, default=2, help="CPU threads on each side (default %(default)s)")
    parser.add_argument("--llama-args", default="", help="more llama-server arguments, e.g. '-ctk f32 -ctv f32'")
    parser.add_argument("--log-dir", help="where llama-server's logs go (default: a temporary folder, kept)")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON")
    args = parser.parse_args(argv)

    arches = [a for a in args.random.split(",") if a]
    unknown = [a for a in arches if a not in RANDOM_ARCHES]
    missing = [p for p in args.gguf if not os.path.isfile(p)]
    problem = (f"--random knows {', '.join(RANDOM_ARCHES)}, not {', '.join(unknown)}" if unknown else
               f"no such file: {', '.join(missing)}" if missing else
               f"no llama-server at {args.llama_server}" if not os.access(args.llama_server, os.X_OK) else
               "give GGUF files or --random" if not args.gguf and not arches else
               f"--steps must be 1 to {MAX_STEPS}" if not 1 <= args.steps <= MAX_STEPS else None)
    if problem:
        print(f"stallfree bench agree: {problem}", file=sys.stderr)
        return 2
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="stallfree-agree-logs-")
    os.makedirs(log_dir, exist_ok=True)
    results: list[FileResult] = []
    with tempfile.TemporaryDirectory(prefix="stallfree-agree-") as scratch:
        try:
            files = [(p, True) for p in args.gguf] + [(p, False) for p in write_random(arches, scratch)]
            for path, cache in files:
                result = check_file(path, args, log_dir, cache)
                print_table(result, args.tolerance)
                results.append(result)
        except (RuntimeError, ValueError, OSError) as e:
            print(f"stallfree bench agree: {e}", file=sys.stderr)
            return 2
    failed = [r.path for r in results if not r.agrees(args.tolerance)]
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"tolerance": args.tolerance, "dtype": args.dtype, "steps": args.steps,
                       "files": [{**asdict(r), "matched": r.matched, "total": r.total, "worst": r.worst,
                                  "agrees": r.agrees(args.tolerance)} for r in results]}, f, indent=2)
    print(f"\n{len(results) - len(failed)}/{len(results)} files agree with llama.cpp"
          + (f"; differ: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
