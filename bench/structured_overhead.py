"""What constrained decoding costs a decode step: engine.step() with every row under a JSON grammar against the
same rows unconstrained, at a few stream counts, on the served model (SmolLM2 by default).

Each row decodes under an array schema with a large minItems, so no row can finish inside the timed window and
every step computes a real JSON mask per row (beside the forward, structured/masks.py). The two cases alternate
in rounds on the same engine, so drift of a shared machine falls on both.

    python -m stallfree.bench.structured_overhead --streams 1,16 --steps 40 --rounds 3
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from stallfree.node_daemon.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from stallfree.contracts import Ceilings, Tuning
from stallfree.node_daemon.engine.engine import LLMEngine
from stallfree.node_daemon.engine.sampling_params import SamplingParams
from stallfree.node_daemon.models.config import ModelConfig
from stallfree.node_daemon.structured.compiler import GrammarCompiler
from stallfree.node_daemon.structured.grammar import compile_response_format

# Never complete within the window: every step's mask is a JSON mask inside a string or between items.
ENDLESS = {"type": "json_schema", "json_schema": {"name": "endless", "schema": {
    "type": "array", "items": {"type": "string", "maxLength": 24}, "minItems": 100000}}}


class _ForwardClock:
    """Wraps the runner's execute_model: the seconds the forward itself took, so a step splits into forward and rest
    (the rest is where the constrained path's critical-path work lands: waiting for masks, applying, accepting)."""

    def __init__(self, runner) -> None:
        self.inner, self.last = runner.execute_model, 0.0
        runner.execute_model = self

    def __call__(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return self.inner(*args, **kwargs)
        finally:
            self.last = time.perf_counter() - start


def _steps(engine: LLMEngine, streams: int, steps: int, grammar, round_id: int,
           forwards: list[float] | None = None) -> list[float]:
    """Per-step seconds of `steps` decode steps with `streams` rows, all prefilled first (not timed); the forward's
    own seconds are appended to `forwards`."""
    for i in range(streams):
        engine.add_request(f"r{round_id}-{i}", prompt_token_ids=[1, 415, 2300 + i, 28, 3 + i],
                           sampling=SamplingParams(max_tokens=steps + 8, temperature=1.0, seed=i, ignore_eos=True),
                           grammar=grammar)
    while engine.scheduler.num_waiting or engine.scheduler.num_partial_prefills:
        engine.step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
        if forwards is not None:
            forwards.append(engine.executor.runner.execute_model.last)
    engine.abort_all()
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--streams", default="1,16", help="rows per step, comma-separated")
    parser.add_argument("--steps", type=int, default=40, help="timed decode steps per case and round")
    parser.add_argument("--rounds", type=int, default=3, help="alternations of unconstrained and constrained")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the mask worker is one more)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    ceilings = Ceilings(max_token_budget=512, max_num_seqs=64)
    engine = LLMEngine(EngineConfig(model=ModelConfig(model=args.model), cache=CacheConfig(num_blocks=1024),
                                    scheduler=SchedulerConfig(ceilings=ceilings,
                                                              tuning=Tuning(token_budget=256, max_num_seqs=64))))
    _ForwardClock(engine.executor.runner)
    compiler = GrammarCompiler(engine.tokenizer, vocab_size=engine.vocab_size)
    grammar = compiler.compile(compile_response_format(ENDLESS))
    print(f"model {args.model}, torch threads {args.threads}, {args.steps} steps x {args.rounds} rounds per case")
    print(f"{'streams':>7} {'free ms/step':>13} {'constrained ms/step':>20} {'overhead':>9}   "
          f"{'forward free/constr.':>21} {'rest free/constr.':>18}   per round")
    round_id = 0
    for streams in [int(s) for s in args.streams.split(",")]:
        _steps(engine, streams, 5, None, round_id - 1)  # warm-up
        _steps(engine, streams, 5, grammar, round_id - 2)
        free, constrained, ratios, free_fwd, constr_fwd = [], [], [], [], []
        for _ in range(args.rounds):
            round_id += 3
            f = _steps(engine, streams, args.steps, None, round_id, free_fwd)
            c = _steps(engine, streams, args.steps, grammar, round_id + 1, constr_fwd)
            free += f
            constrained += c
            ratios.append(statistics.median(c) / statistics.median(f) - 1)
        f, c = statistics.median(free) * 1e3, statistics.median(constrained) * 1e3
        ff, cf = statistics.median(free_fwd) * 1e3, statistics.median(constr_fwd) * 1e3
        fr = statistics.median(t - w for t, w in zip(free, free_fwd)) * 1e3
        cr = statistics.median(t - w for t, w in zip(constrained, constr_fwd)) * 1e3
        rounds = " ".join(f"{100 * r:+.1f}%" for r in ratios)
        print(f"{streams:>7} {f:>13.2f} {c:>20.2f} {100 * (c - f) / f:>8.1f}%   {ff:>10.2f}/{cf:<10.2f} "
              f"{fr:>8.2f}/{cr:<9.2f}   {rounds}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
