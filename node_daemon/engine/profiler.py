"""The start-up profile: iteration time against tokens per iteration, measured through the real engine.

Synthetic requests go through LLMEngine.step() exactly as served ones do (scheduler, block tables, model
runner or sim executor, sampler), on the daemon's own device, before it serves:

- decode-only: b requests decoding together, b = 1, 2, 4, ... up to max_num_seqs (its ceiling);
- mixed: d running decodes plus one fresh prompt of T - d tokens prefilled in the same iteration, for
  token budgets T = 64, 128, ... up to the budget ceiling. This is the curve Sarathi-Serve picks the
  budget from: the largest T whose iteration time fits the TPOT target.

Each point is the median of a few iterations after a warm-up; points run cheapest first (the mixed curve
before the decode-only one) until `max_seconds` is spent. Prompts are random token ids, distinct per
request, so the prefix cache never shortens a measured prefill. The engine's observer is detached while
profiling (synthetic iterations must not reach the metrics or the stats window) and every synthetic
request is aborted afterwards, so the engine starts serving empty with its tuning restored.
"""
from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass

from stallfree.contracts import Ceilings, Profile, ProfilePoint, Tuning, min_budget_for
from stallfree.node_daemon.engine.engine import LLMEngine
from stallfree.node_daemon.engine.engine_protocol import IterationRecord
from stallfree.node_daemon.engine.request import Request
from stallfree.node_daemon.engine.sampling_params import SamplingParams


@dataclass
class ProfileSettings:
    repeats: int = 3  # measured iterations per point (the median is kept)
    warmup: int = 1  # iterations per point that are run but not kept
    decode_context: int = 64  # prompt tokens of each decoding request
    mixed_decodes: int = 16  # running decodes beside the prefill chunk on the mixed curve
    max_seconds: float = 60.0  # stop adding points past this (the cheap points come first)
    max_tokens: int | None = None  # largest mixed point (default: the budget ceiling)
    max_decodes: int | None = None  # largest decode-only batch (default: the max_num_seqs ceiling)


class _Recorder:
    """Stands in for the engine's observer while profiling: keeps iteration records only."""

    def __init__(self) -> None:
        self.records: list[IterationRecord] = []

    def on_iteration(self, record: IterationRecord) -> None:
        self.records.append(record)

    def on_token(self, request: Request, now: float, first: bool) -> None:
        pass

    def on_finished(self, request: Request, now: float) -> None:
        pass


def _doubling(start: int, stop: int) -> list[int]:
    points, value = [], start
    while value < stop:
        points.append(value)
        value *= 2
    points.append(stop)
    return sorted(set(p for p in points if p >= 1))


class _Profiler:
    def __init__(self, engine: LLMEngine, settings: ProfileSettings) -> None:
        self.engine = engine
        self.settings = settings
        self.recorder = _Recorder()
        self.rng = random.Random(1234)
        self.vocab_lo = 16 if engine.vocab_size > 64 else 0  # keep clear of special tokens at the start
        self.serial = 0
        self.decoders: list[str] = []
        self.deadline = time.monotonic() + settings.max_seconds

    def _prompt(self, length: int) -> list[int]:
        return [self.rng.randrange(self.vocab_lo, self.engine.vocab_size) for _ in range(length)]

    def _add(self, prompt_len: int, max_tokens: int) -> str:
        self.serial += 1
        request_id = f"profile-{self.serial}"
        sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        self.engine.add_request(request_id, prompt_token_ids=self._prompt(prompt_len), sampling=sampling)
        return request_id

    def _step(self) -> IterationRecord | None:
        before = len(self.recorder.records)
        self.engine.step()
        return self.recorder.records[-1] if len(self.recorder.records) > before else None

    def _set(self, token_budget: int, max_num_seqs: int) -> None:
        self.engine.set_tuning(Tuning(token_budget=token_budget, max_num_seqs=max_num_seqs,
                                      max_partial_prefills=1, long_prefill_threshold=0))

    def _decoding(self, request_id: str) -> bool:
        request = self.engine.scheduler.get_request(request_id)
        return request is not None and bool(request.output_token_ids) and request.num_tokens_to_compute <= 1

    def _grow_decoders(self, count: int, ceilings: Ceilings) -> bool:
        """Bring the decoding pool to `count` requests; False if they do not all get to decode."""
        # Enough output tokens to outlive every point (the KV admission reserves all of them up front).
        steps_per_point = self.settings.warmup + self.settings.repeats + 8
        max_tokens = max(1, min(self.engine.max_model_len - self.settings.decode_context - 1, 20 * steps_per_point))
        while len(self.decoders) < count:
            self.decoders.append(self._add(self.settings.decode_context, max_tokens))
        self._set(ceilings.max_token_budget, max(count, 1))
        for _ in range(4 * count + 16):
            if all(self._decoding(r) for r in self.decoders):
                return True
            self._step()
        return all(self._decoding(r) for r in self.decoders)

    def _shrink_decoders(self, count: int) -> None:
        while len(self.decoders) > count:
            self.engine.abort_request(self.decoders.pop())

    def _measure(self, expect_decode: int, expect_prefill: int, before_each=None) -> float | None:
        times = []
        for i in range(self.settings.warmup + self.settings.repeats):
            if before_each is not None:
                before_each()
            record = self._step()
            if record is None or record.num_decode_tokens != expect_decode or record.num_prefill_tokens != expect_prefill:
                return None  # the engine scheduled something else (KV pressure): no clean point
            if i >= self.settings.warmup:
                times.append(record.duration_s * 1000.0)
        return statistics.median(times)

    def decode_only(self, ceilings: Ceilings) -> list[ProfilePoint]:
        top = min(self.settings.max_decodes or ceilings.max_num_seqs, ceilings.max_num_seqs)
        # max_num_seqs b needs a budget of at least min_budget_for(b) under the ceiling.
        while top > 1 and min_budget_for(top) > ceilings.max_token_budget:
            top -= 1
        points = []
        for batch in _doubling(1, top):
            if time.monotonic() > self.deadline or not self._grow_decoders(batch, ceilings):
                break
            ms = self._measure(expect_decode=batch, expect_prefill=0)
            if ms is None:
                break
            points.append(ProfilePoint(tokens=batch, num_decodes=batch, iteration_ms=ms))
        return points

    def mixed(self, ceilings: Ceilings) -> list[ProfilePoint]:
        decodes = max(1, min(self.settings.mixed_decodes, ceilings.max_num_seqs - 1))
        self._shrink_decoders(decodes)
        if not self._grow_decoders(decodes, ceilings):
            return []
        top = min(self.settings.max_tokens or ceilings.max_token_budget, ceilings.max_token_budget,
                  self.engine.max_model_len - 1 + decodes)
        start = max(64, min_budget_for(decodes + 1))
        points = []
        for budget in _doubling(start, top):
            if time.monotonic() > self.deadline:
                break
            prefill = budget - decodes
            self._set(budget, decodes + 1)
            # max_tokens=1: the prompt samples its one token in the same iteration and leaves.
            ms = self._measure(expect_decode=decodes, expect_prefill=prefill,
                               before_each=lambda: self._add(prefill, 1))
            if ms is None:
                break
            points.append(ProfilePoint(tokens=budget, num_decodes=decodes, iteration_ms=ms))
        return points

    def cleanup(self) -> None:
        """Abort every synthetic request still in the engine (finished ones are unknown to it: a no-op)."""
        for serial in range(1, self.serial + 1):
            self.engine.abort_request(f"profile-{serial}")
        self.decoders.clear()


def measure_profile(engine: LLMEngine, device: str, settings: ProfileSettings | None = None) -> Profile:
    """Run the synthetic sweep on an idle engine and return the measured Profile."""
    if engine.has_unfinished():
        raise RuntimeError("profile an idle engine: it has requests in flight")
    settings = settings or ProfileSettings()
    profiler = _Profiler(engine, settings)
    saved_observer, saved_tuning = engine.observer, engine.get_tuning()
    engine.observer = profiler.recorder
    ceilings = engine.ceilings
    try:
        # The mixed curve first: the starting budget comes from it, so it gets the time cap's first share.
        mixed = profiler.mixed(ceilings)
        profiler._shrink_decoders(0)
        decode_only = profiler.decode_only(ceilings)
    finally:
        profiler.cleanup()
        engine.set_tuning(saved_tuning)
        engine.observer = saved_observer
    return Profile(device=device, decode_only=decode_only, mixed=mixed)


def suggest_token_budget(profile: Profile, tpot_slo_ms: float, ceilings: Ceilings, max_num_seqs: int) -> int:
    """Sarathi-Serve's recipe: the largest budget whose iteration time fits the TPOT target,
    kept between max_num_seqs' prefill floor and the ceiling."""
    if not profile.mixed:
        raise ValueError("the profile has no mixed points to choose a budget from")
    return profile.budget_for(tpot_slo_ms, lo=min_budget_for(max_num_seqs), hi=ceilings.max_token_budget)


def starting_tuning(profile: Profile, tpot_slo_ms: float, ceilings: Ceilings, tuning: Tuning) -> Tuning:
    """The tuning a daemon starts with when told its TPOT SLO and no explicit budget.

    When even the floor for `tuning.max_num_seqs` would overrun the target, max_num_seqs comes down so
    the budget can (a budget must leave prefill room beside every decode)."""
    budget = profile.budget_for(tpot_slo_ms, lo=1, hi=ceilings.max_token_budget)
    max_num_seqs = min(tuning.max_num_seqs, ceilings.max_num_seqs)
    while max_num_seqs > 1 and min_budget_for(max_num_seqs) > budget:
        max_num_seqs -= 1
    budget = max(budget, min_budget_for(max_num_seqs))
    return Tuning(token_budget=min(budget, ceilings.max_token_budget), max_num_seqs=max_num_seqs,
                  max_partial_prefills=tuning.max_partial_prefills,
                  long_prefill_threshold=tuning.long_prefill_threshold)
