"""`stallfree bench agree-rate`: greedy agreement with the float reference on 120 varied prompts, stallfree's serving
path beside llama.cpp's.

The REFERENCE is the GGUF file dequantized to float32: stallfree's Python forward at `dtype float32` (every tensor's
codes dequantized, no compiled path). Against it run, on the same file and the same token ids (bench/agree_prompts.py,
tokenized by the file's own tokenizer):
- stallfree's SERVING path, as `stallfree serve` runs it: bfloat16, the compiled CPU forward over the codes, dense
  weights released, prefill in 256-token chunks (the CPU token budget), then one decode iteration per step over
  --streams sequences (16: the reference is decoded in the same groups);
- llama.cpp's llama-server on the file, a child on a loopback port (bench/agree.py starts it).
Each decodes --steps tokens greedily (past an end of generation) with the top-5 logprobs at every step.

Per system: the share of prompts whose continuation equals the reference's, the mean matched prefix, and the max and
mean |logprob difference| over the tokens in both top-5 lists at every position whose context equals the
reference's (the first, and each one before the first different token). Exits 1 when stallfree's agreement rate is
below llama.cpp's on any file, 2 on bad input or a failed run.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

from stallfree.bench import agree
from stallfree.bench.agree import Trace

STEPS = 16
STREAMS = 16  # the engine table's many-stream row; llama-server answers one request at a time
SERVING_CHUNK = 256  # node_daemon/daemon.py's CPU_TOKEN_BUDGET: a serving prefill's chunk
REFERENCE = "reference"
SERVING = "stallfree"
LLAMA = "llama.cpp"


@dataclass
class Score:
    """One system's traces against the reference's on one file."""
    system: str
    prompts: int
    identical: int  # prompts whose whole continuation equals the reference's
    matched: list[int]  # per prompt: tokens equal before the first difference
    max_diff: float  # over the top-5 tokens both sides list, at the positions whose context equals the reference's
    mean_diff: float
    compared: int  # (position, token) pairs behind mean_diff

    @property
    def rate(self) -> float:
        return self.identical / self.prompts if self.prompts else 0.0

    @property
    def mean_matched(self) -> float:
        return sum(self.matched) / len(self.matched) if self.matched else 0.0


def score(system: str, reference: list[Trace], traces: list[Trace]) -> Score:
    if len(reference) != len(traces):
        raise ValueError(f"{len(traces)} {system} traces against {len(reference)} of the reference")
    identical, matched, diffs = 0, [], []
    for ref, ours in zip(reference, traces):
        n = 0
        while n < min(len(ref.tokens), len(ours.tokens)) and ref.tokens[n] == ours.tokens[n]:
            n += 1
        matched.append(n)
        identical += n == len(ref.tokens) == len(ours.tokens)
        # step k's distribution follows the reference's context while the k tokens before it agree
        for a, b in zip(ref.top[:n + 1], ours.top[:n + 1]):
            diffs += [abs(a[t] - b[t]) for t in a.keys() & b.keys()]
    return Score(system, len(reference), identical, matched, max(diffs, default=0.0),
                 sum(diffs) / len(diffs) if diffs else 0.0, len(diffs))


def goal_met(scores: list[Score]) -> bool:
    """stallfree's serving path agrees with the reference at least as often as llama.cpp does."""
    by_system = {s.system: s for s in scores}
    return by_system[SERVING].identical >= by_system[LLAMA].identical


# --- the systems ----------------------------------------------------------------------------------------------------

def runner_for(path: str, serving: bool, threads: int, longest: int, steps: int, streams: int,
               dense_copy: str = "auto"):
    """stallfree's float32 reference (the Python forward over dequantized tensors) or its serving path (with
    `dense_copy` as serve's --cpu-dense-copy)."""
    from stallfree.node_daemon.engine.config import CacheConfig
    from stallfree.node_daemon.engine.model_runner import ModelRunner
    from stallfree.node_daemon.models.config import ModelConfig

    config = (ModelConfig(model=path, dtype="bfloat16", threads=threads, compiled_decode="now",
                          release_dense_weights=True, cpu_dense_copy=dense_copy) if serving else
              ModelConfig(model=path, dtype="float32", threads=threads))
    blocks = streams * -(-(longest + steps) // agree.BLOCK_SIZE)
    return ModelRunner(config, CacheConfig(block_size=agree.BLOCK_SIZE, num_blocks=blocks),
                       max_num_tokens=max(SERVING_CHUNK, longest, streams), max_num_seqs=streams)


def batched_traces(runner, prompts: list[list[int]], steps: int, chunk: int, streams: int) -> list[Trace]:
    """Greedy continuations through runner.execute_model, `streams` prompts at a time as the engine batches them:
    each prompt prefilled alone in chunks, then one decode iteration per step over the group's sequences."""
    from stallfree.node_daemon.engine.request import Request
    from stallfree.node_daemon.engine.sampling_params import SamplingParams
    from stallfree.node_daemon.engine.scheduler_output import ScheduledChunk, SchedulerOutput

    per_request = max(-(-(len(p) + steps) // runner.block_size) for p in prompts)
    traces = []
    for first in range(0, len(prompts), streams):
        group = prompts[first:first + streams]
        reqs, logits = [], []
        for k, prompt in enumerate(group):
            req = Request(f"agree-rate-{first + k}", list(prompt), SamplingParams(max_tokens=steps))
            req.block_ids = list(range(k * per_request, (k + 1) * per_request))
            for pos in range(0, len(prompt), chunk):
                n = min(chunk, len(prompt) - pos)
                last = pos + n == len(prompt)
                out = runner.execute_model(SchedulerOutput(chunks=[ScheduledChunk(req, pos, n, True, last)]))
            req.num_computed_tokens = len(prompt)
            reqs.append(req)
            logits.append(out[0])
        group_traces = [Trace([], []) for _ in group]
        for step in range(steps):
            for req, trace, row in zip(reqs, group_traces, logits):
                trace.top.append(agree._top(row))
                trace.tokens.append(int(row.argmax()))
                req.append_output_token(trace.tokens[-1])
            if step + 1 < steps:
                out = runner.execute_model(SchedulerOutput(
                    chunks=[ScheduledChunk(r, r.num_tokens - 1, 1, False, True) for r in reqs]))
                logits = list(out)
                for req in reqs:
                    req.num_computed_tokens = req.num_tokens
        traces += group_traces
    return traces


def stallfree_side(path: str, serving: bool, threads: int, prompts: list[list[int]], steps: int,
                   streams: int, dense_copy: str = "auto") -> list[Trace]:
    longest = max(map(len, prompts))
    runner = runner_for(path, serving, threads, longest, steps, streams, dense_copy)
    if serving and runner.cpu_decode is None:
        print(f"  note: the compiled forward is off on {os.path.basename(path)}: the serving path runs the Python "
              "forward in bfloat16", file=sys.stderr)
    # the reference prefills a prompt at once; the serving path as the daemon's token budget cuts it
    return batched_traces(runner, prompts, steps, SERVING_CHUNK if serving else longest, streams)


def llama_side(binary: str, path: str, log_path: str, threads: int, extra: list[str], prompts: list[list[int]],
               steps: int) -> list[Trace]:
    with agree.llama_server(binary, path, log_path, threads, extra) as url:
        return agree.llama_traces(url, prompts, steps, ignore_eos=True)


def check_file(path: str, args, log_dir: str) -> tuple[list, list[Score]]:
    from stallfree.bench.agree_prompts import build_prompts
    from stallfree.node_daemon.text.tokenizer import load_tokenizer

    prompts = build_prompts(load_tokenizer(path))
    ids = [list(p.tokens) for p in prompts]
    print(f"\n{path}: {len(ids)} prompts of {min(map(len, ids))}-{max(map(len, ids))} tokens, {args.steps} greedy "
          "steps each", flush=True)
    started = time.monotonic()
    reference = stallfree_side(path, False, args.threads, ids, args.steps, args.streams)
    print(f"  reference (float32) done in {time.monotonic() - started:.0f} s", flush=True)
    serving = stallfree_side(path, True, args.threads, ids, args.steps, args.streams, args.cpu_dense_copy)
    print(f"  {SERVING} serving path done in {time.monotonic() - started:.0f} s", flush=True)
    log_path = os.path.join(log_dir, f"llama-server-{os.path.basename(path)}.log")
    llama = llama_side(args.llama_server, path, log_path, args.threads, shlex.split(args.llama_args), ids, args.steps)
    print(f"  {LLAMA} done in {time.monotonic() - started:.0f} s; llama-server log: {log_path}", flush=True)
    return prompts, [score(SERVING, reference, serving), score(LLAMA, reference, llama)]


def print_table(path: str, scores: list[Score], steps: int) -> None:
    print(f"\n{os.path.basename(path)}: against the float32 reference (the file dequantized), {steps} greedy steps")
    print(f"  {'system':<10} {'identical continuations':>24} {'mean matched prefix':>20} "
          f"{'top-5 |dlogprob| max':>21} {'mean':>9}")
    for s in scores:
        print(f"  {s.system:<10} {f'{s.identical}/{s.prompts} ({s.rate:.0%})':>24} "
              f"{f'{s.mean_matched:.2f}/{steps}':>20} {s.max_diff:>21.3f} {s.mean_diff:>9.4f}")
    print(f"  goal: {SERVING} identical >= {LLAMA}'s: {'met' if goal_met(scores) else 'MISSED'}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="stallfree bench agree-rate", description=__doc__.split("\n\n")[0])
    parser.add_argument("gguf", nargs="+", help="GGUF files to check")
    parser.add_argument("--llama-server", required=True, metavar="PATH", help="llama.cpp's llama-server binary")
    parser.add_argument("--steps", type=int, default=STEPS, help="greedy tokens per prompt (default %(default)s)")
    parser.add_argument("--streams", type=int, default=STREAMS,
                        help="stallfree's sequences decoded together, as a server batches them (default %(default)s)")
    parser.add_argument("--threads", type=int, default=2, help="CPU threads on each side (default %(default)s)")
    parser.add_argument("--cpu-dense-copy", choices=("auto", "on", "off"), default="auto",
                        help="the serving path's oneDNN copies, as serve's flag (off: the codes take every row count, "
                             "int8 activations past a few rows where the CPU has VNNI)")
    parser.add_argument("--llama-args", default="", help="more llama-server arguments")
    parser.add_argument("--log-dir", help="where llama-server's logs go (default: a temporary folder, kept)")
    parser.add_argument("--json", metavar="PATH", help="write the scores and every prompt's matched prefix as JSON")
    args = parser.parse_args(argv)

    missing = [p for p in args.gguf if not os.path.isfile(p)]
    problem = (f"no such file: {', '.join(missing)}" if missing else
               f"no llama-server at {args.llama_server}" if not os.access(args.llama_server, os.X_OK) else
               f"--steps must be 1 to {agree.MAX_STEPS}" if not 1 <= args.steps <= agree.MAX_STEPS else
               "--streams must be at least 1" if args.streams < 1 else None)
    if problem:
        print(f"stallfree bench agree-rate: {problem}", file=sys.stderr)
        return 2
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="stallfree-agree-rate-logs-")
    os.makedirs(log_dir, exist_ok=True)
    report, missed = [], []
    for path in args.gguf:
        try:
            prompts, scores = check_file(path, args, log_dir)
        except (RuntimeError, ValueError, OSError) as e:
            print(f"stallfree bench agree-rate: {path}: {e}", file=sys.stderr)
            return 2
        print_table(path, scores, args.steps)
        if not goal_met(scores):
            missed.append(path)
        report.append({"path": path, "goal_met": goal_met(scores),
                       "prompts": [{"subject": p.subject, "form": p.form, "tokens": len(p.tokens)} for p in prompts],
                       "scores": [{**asdict(s), "rate": s.rate, "mean_matched": s.mean_matched} for s in scores]})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"steps": args.steps, "reference": "stallfree float32 (every tensor dequantized)",
                       "files": report}, f, indent=2)
    print(f"\n{len(report) - len(missed)}/{len(report)} files: {SERVING} agrees with the reference as often as "
          f"{LLAMA} or more" + (f"; missed on {', '.join(missed)}" if missed else ""))
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
