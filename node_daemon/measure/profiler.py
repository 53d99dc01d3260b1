"""The start-up profile: iteration time against tokens per iteration, measured through the real engine.

Synthetic requests go through LLMEngine.step() exactly as served ones do (scheduler, block tables, model
runner or sim executor, sampler), on the daemon's own device, before it serves:

- mixed: d running decodes plus one fresh prompt of T - d tokens prefilled in the same iteration, for
  token budgets T = 64, 128, ... up to the budget ceiling. This is the curve Sarathi-Serve picks the
  budget from: the largest T whose iteration time fits the TPOT target.
- decode-only: b requests decoding together, b = 1, 2, 4, ... up to max_num_seqs (its ceiling).

Bounded by a time budget, whatever the model's speed: points run cheapest first (the mixed curve, then
the decode-only one), and before each point its cost is predicted from the points already measured
(a straight line through them); a point that would not fit in what is left is skipped, and no step
starts past the deadline. Between measured points the curve is interpolated, past them extrapolated
along the last segment (contracts.Curve's end rule), so a few points serve every budget.

A busy machine must not pass for a slow engine: each point runs `repeats` times and keeps the fastest;
a curve that is not monotone (more tokens faster), or jumps more than a straight line allows, has its
suspect points measured again (fastest kept); what is still wrong afterwards is reported in
`ProfileRun.warnings` and the run is not `trusted` (the caller does not cache it and measures again
later). Prompts are random token ids, distinct per request and per run, so the prefix cache never
shortens a measured prefill. The engine's observer is detached while profiling (synthetic iterations must not reach
the metrics or the stats window) and every synthetic request is aborted afterwards, so the engine
starts serving empty with its tuning restored.
"""
from __future__ import annotations

import dataclasses
import random
import time
from dataclasses import dataclass, field
from typing import Callable

from stallfree.contracts import Ceilings, Curve, Profile, ProfilePoint, Tuning, min_budget_for
from stallfree.profile_rules import MIN_TOKEN_BUDGET, SLO_MARGIN, budget_for_tpot, give_way
from stallfree.node_daemon.engine.engine import LLMEngine
from stallfree.node_daemon.engine.engine_protocol import IterationRecord
from stallfree.node_daemon.engine.request import Request
from stallfree.node_daemon.engine.sampling_params import SamplingParams

# More tokens may cost a little less than fewer within this tolerance (timer noise at small points).
MONOTONE_TOLERANCE = 0.95
# A point may cost at most this much more than a straight line from the origin through its lower neighbour.
JUMP_TOLERANCE = 1.5
# On a CPU device the profile must get at least this share of its threads' time, else the machine is busy.
MIN_CPU_SHARE = 0.6
# The SLO never lowers max_num_seqs below this (a daemon that runs one request at a time is not serving).
MIN_STARTING_SEQS = 8


@dataclass
class ProfileSettings:
    repeats: int = 2  # measured iterations per point (the fastest is kept)
    warmup: int = 0  # iterations run before the first point and not kept (the pool's own prefill warms up)
    decode_context: int = 32  # prompt tokens of each decoding request
    mixed_decodes: int = 4  # running decodes beside the prefill chunk on the mixed curve
    max_seconds: float = 5.0  # the time budget of the whole profile
    max_tokens: int | None = None  # largest mixed point (default: the budget ceiling)
    max_decodes: int | None = None  # largest decode-only batch (default: the max_num_seqs ceiling)
    remeasure: int = 2  # extra runs of a suspect point
    progress: Callable[[str], None] | None = None  # one line per step
    should_stop: Callable[[], bool] | None = None  # checked between iterations: abandon the run


@dataclass
class ProfileRun:
    profile: Profile
    seconds: float
    warnings: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # points left out for the time budget
    stopped: bool = False  # should_stop() ended it early
    cpu_share: float | None = None  # process CPU seconds per wall second per thread while measuring (CPU only)

    @property
    def trusted(self) -> bool:
        """Measured quietly and completely enough to cache as this engine's truth."""
        return not self.warnings and not self.stopped and bool(self.profile.mixed)


class _Stop(Exception):
    pass


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


def predict_ms(points: list[ProfilePoint], tokens: int) -> float:
    """The iteration time of `tokens` on the curve through the points measured so far (Curve's end rule)."""
    return Curve.through((p.tokens, p.iteration_ms) for p in points).at(tokens)


class _Profiler:
    def __init__(self, engine: LLMEngine, settings: ProfileSettings) -> None:
        self.engine = engine
        self.settings = settings
        self.recorder = _Recorder()
        self.rng = random.Random(time.monotonic_ns())  # another run on this engine must miss its prefix cache too
        self.vocab_lo = 16 if engine.vocab_size > 64 else 0  # keep clear of special tokens at the start
        self.serial = 0
        self.decoders: list[str] = []
        self.started = time.monotonic()
        self.deadline = self.started + settings.max_seconds
        self.warm = settings.warmup <= 0
        self.index = 0
        self.total = 0
        self.samples: dict[tuple[str, int], list[float]] = {}
        self.skipped: list[str] = []

    # ---- plumbing ----

    def _say(self, message: str) -> None:
        if self.settings.progress is not None:
            self.settings.progress(message)

    def _left(self) -> float:
        return self.deadline - time.monotonic()

    def _prompt(self, length: int) -> list[int]:
        return [self.rng.randrange(self.vocab_lo, self.engine.vocab_size) for _ in range(length)]

    def _add(self, prompt_len: int, max_tokens: int) -> str:
        self.serial += 1
        request_id = f"profile-{self.serial}"
        sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        self.engine.add_request(request_id, prompt_token_ids=self._prompt(prompt_len), sampling=sampling,
                                prefix_cache=False)
        return request_id

    def _step(self) -> IterationRecord | None:
        stop = self.settings.should_stop
        if stop is not None and stop():
            raise _Stop()
        before = len(self.recorder.records)
        self.engine.step()
        return self.recorder.records[-1] if len(self.recorder.records) > before else None

    def _set(self, token_budget: int, max_num_seqs: int) -> None:
        self.engine.set_tuning(Tuning(token_budget=token_budget, max_num_seqs=max_num_seqs,
                                      max_partial_prefills=1, long_prefill_threshold=0))

    def _decoding(self, request_id: str) -> bool:
        request = self.engine.scheduler.get_request(request_id)
        return request is not None and request.num_output_tokens > 0 and request.num_tokens_to_compute <= 1

    def _grow_decoders(self, count: int, ceilings: Ceilings) -> bool:
        """Bring the decoding pool to `count` requests; False if they do not all get to decode."""
        # Enough output tokens to outlive every point (the KV admission reserves all of them up front).
        steps_per_point = self.settings.warmup + self.settings.repeats + self.settings.remeasure + 8
        max_tokens = max(1, min(self.engine.max_model_len - self.settings.decode_context - 1, 20 * steps_per_point))
        while len(self.decoders) < count:
            self.decoders.append(self._add(self.settings.decode_context, max_tokens))
        self._set(ceilings.max_token_budget, max(count, 1))
        for _ in range(4 * count + 16):
            if all(self._decoding(r) for r in self.decoders):
                return True
            if self._left() <= 0 and self.samples:
                return False  # past the deadline with something measured: stop here
            self._step()
        return all(self._decoding(r) for r in self.decoders)

    def _shrink_decoders(self, count: int) -> None:
        while len(self.decoders) > count:
            self.engine.abort_request(self.decoders.pop())

    def _run(self, kind: str, tokens: int, runs: int, expect_decode: int, expect_prefill: int,
             before_each=None) -> float | None:
        """`runs` iterations of one point (after the warm-up, once); the fastest of all its samples so far."""
        samples = self.samples.setdefault((kind, tokens), [])
        warmup = 0 if self.warm else self.settings.warmup
        for i in range(warmup + runs):
            if samples and self._left() <= 0:
                break  # the deadline holds mid-point too; one sample is a point
            if before_each is not None:
                before_each()
            record = self._step()
            if record is None or record.num_decode_tokens != expect_decode or record.num_prefill_tokens != expect_prefill:
                return None  # the engine scheduled something else (KV pressure): no clean point
            if i >= warmup:
                samples.append(record.duration_s * 1000.0)
        self.warm = True
        return min(samples) if samples else None

    def _fits(self, labels: list[str], predicted_s: float) -> bool:
        """Whether the next point (labels[0]) fits what is left; if not, it and the larger ones are skipped."""
        left = self._left()
        if predicted_s <= left:
            return True
        self.skipped += labels
        first, last = self.index + 1, self.index + len(labels)
        which = f"{first}" if first == last else f"{first}-{last}"
        self._say(f"profile point {which}/{self.total} skipped: {labels[0]}{' and larger' if len(labels) > 1 else ''} "
                  f"(predicted {predicted_s:.1f} s, {max(left, 0.0):.1f} s left of {self.settings.max_seconds:g} s)")
        self.index += len(labels)
        return False

    def _report(self, label: str, key: tuple[str, int], ms: float, started: float) -> None:
        self.index += 1
        runs = len(self.samples.get(key, ())) or 1
        self._say(f"profile point {self.index}/{self.total}: {label}: {ms:.1f} ms "
                  f"(fastest of {runs}, {time.monotonic() - started:.1f} s)")

    # ---- the curves ----

    def mixed_plan(self, ceilings: Ceilings) -> tuple[int, list[int]]:
        decodes = max(1, min(self.settings.mixed_decodes, ceilings.max_num_seqs - 1))
        top = min(self.settings.max_tokens or ceilings.max_token_budget, ceilings.max_token_budget,
                  self.engine.max_model_len - 1 + decodes)
        start = max(MIN_TOKEN_BUDGET, min_budget_for(decodes + 1))
        return decodes, _doubling(start, top) if top >= start else []

    def decode_plan(self, ceilings: Ceilings) -> list[int]:
        top = min(self.settings.max_decodes or ceilings.max_num_seqs, ceilings.max_num_seqs)
        # max_num_seqs b needs a budget of at least min_budget_for(b) under the ceiling.
        while top > 1 and min_budget_for(top) > ceilings.max_token_budget:
            top -= 1
        return _doubling(1, top)

    def mixed(self, ceilings: Ceilings, decodes: int, budgets: list[int]) -> list[ProfilePoint]:
        points: list[ProfilePoint] = []
        if not budgets:
            return points
        self._shrink_decoders(decodes)
        if not self._grow_decoders(decodes, ceilings):
            return points
        for i, budget in enumerate(budgets):
            label = f"mixed {budget} tokens ({decodes} decodes)"
            runs = self.settings.repeats
            if points and not self._fits([f"mixed {b} tokens ({decodes} decodes)" for b in budgets[i:]],
                                         runs * predict_ms(points, budget) / 1000.0):
                break
            started = time.monotonic()
            ms = self._measure_mixed(budget, decodes, runs)
            if ms is None:
                break
            points.append(ProfilePoint(tokens=budget, num_decodes=decodes, iteration_ms=ms))
            self._report(label, ("mixed", budget), ms, started)
        return points

    def _measure_mixed(self, budget: int, decodes: int, runs: int) -> float | None:
        prefill = budget - decodes
        self._set(budget, decodes + 1)
        # max_tokens=1: the prompt samples its one token in the same iteration and leaves.
        return self._run("mixed", budget, runs, expect_decode=decodes, expect_prefill=prefill,
                         before_each=lambda: self._add(prefill, 1))

    def decode_only(self, ceilings: Ceilings, batches: list[int], mixed: list[ProfilePoint]) -> list[ProfilePoint]:
        points: list[ProfilePoint] = []
        self._shrink_decoders(0)
        for i, batch in enumerate(batches):
            label = f"decode-only batch {batch}"
            if mixed:
                # Prefill of the new decoders, then the runs (a decode step costs at most a mixed one).
                new = max(0, batch - len(self.decoders)) * self.settings.decode_context
                cost_ms = (predict_ms(mixed, new) if new else 0.0) + self.settings.repeats * predict_ms(mixed, batch)
                if not self._fits([f"decode-only batch {b}" for b in batches[i:]], cost_ms / 1000.0):
                    return points
            elif self._left() <= 0:
                break
            started = time.monotonic()
            if not self._grow_decoders(batch, ceilings):
                break
            ms = self._run("decode", batch, self.settings.repeats, expect_decode=batch, expect_prefill=0)
            if ms is None:
                break
            points.append(ProfilePoint(tokens=batch, num_decodes=batch, iteration_ms=ms))
            self._report(label, ("decode", batch), ms, started)
        for batch in batches[len(points):]:
            label = f"decode-only batch {batch}"
            if label not in self.skipped:
                self.skipped.append(label)
        return points

    def check_and_repair(self, ceilings: Ceilings, decodes: int, points: list[ProfilePoint]) -> tuple[
            list[ProfilePoint], list[str]]:
        """Measure suspect points again (fastest kept); the problems that remain."""
        suspects = suspect_points(points)
        if suspects and self.settings.remeasure > 0:
            by_tokens = {p.tokens: p for p in points}
            self._shrink_decoders(decodes)
            if self._grow_decoders(decodes, ceilings):
                for tokens in suspects:
                    cost = self.settings.remeasure * by_tokens[tokens].iteration_ms / 1000.0
                    if cost > self._left():
                        continue
                    ms = self._measure_mixed(tokens, decodes, self.settings.remeasure)
                    if ms is not None:
                        by_tokens[tokens] = ProfilePoint(tokens, decodes, ms)
                        self._say(f"profile: re-measured mixed {tokens} tokens: {ms:.1f} ms (fastest of "
                                  f"{len(self.samples[('mixed', tokens)])})")
            points = [by_tokens[t] for t in sorted(by_tokens)]
        return points, curve_problems(points)

    def cleanup(self) -> None:
        """Abort every synthetic request still in the engine (finished ones are unknown to it: a no-op)."""
        for serial in range(1, self.serial + 1):
            self.engine.abort_request(f"profile-{serial}")
        self.decoders.clear()


def curve_problems(points: list[ProfilePoint]) -> list[str]:
    """What makes a mixed curve implausible for one machine: more tokens faster, or a jump past linear."""
    problems = []
    points = sorted(points, key=lambda p: p.tokens)
    for lo, hi in zip(points, points[1:]):
        if hi.iteration_ms < MONOTONE_TOLERANCE * lo.iteration_ms:
            problems.append(f"not monotone: {hi.tokens} tokens took {hi.iteration_ms:.1f} ms, "
                            f"{lo.tokens} tokens {lo.iteration_ms:.1f} ms")
        elif hi.iteration_ms > JUMP_TOLERANCE * lo.iteration_ms * hi.tokens / lo.tokens:
            problems.append(f"jump: {hi.tokens} tokens took {hi.iteration_ms:.1f} ms, more than "
                            f"{JUMP_TOLERANCE:g}x linear from {lo.tokens} tokens at {lo.iteration_ms:.1f} ms")
    return problems


def suspect_points(points: list[ProfilePoint]) -> list[int]:
    """Token counts of the points on either side of each problem (either may be the slow one)."""
    points = sorted(points, key=lambda p: p.tokens)
    suspects: list[int] = []
    for lo, hi in zip(points, points[1:]):
        if curve_problems([lo, hi]):
            suspects += [t for t in (lo.tokens, hi.tokens) if t not in suspects]
    return suspects


def run_profile(engine: LLMEngine, device: str, settings: ProfileSettings | None = None) -> ProfileRun:
    """Measure the profile of an idle engine within settings.max_seconds; the Profile and its verdict."""
    if engine.has_unfinished():
        raise RuntimeError("profile an idle engine: it has requests in flight")
    settings = settings or ProfileSettings()
    profiler = _Profiler(engine, settings)
    saved_observer, saved_tuning = engine.observer, engine.get_tuning()
    engine.observer = profiler.recorder
    # The profile times plain decodes and prefill chunks: drafts would add verification rows to its points.
    saved_speculative = engine.scheduler.speculative
    engine.scheduler.speculative = dataclasses.replace(saved_speculative, method="off")
    ceilings = engine.ceilings
    decodes, budgets = profiler.mixed_plan(ceilings)
    batches = profiler.decode_plan(ceilings)
    profiler.total = len(budgets) + len(batches)
    mixed: list[ProfilePoint] = []
    decode_only: list[ProfilePoint] = []
    warnings: list[str] = []
    stopped = False
    cpu_started, wall_started = time.process_time(), time.monotonic()
    try:
        # The mixed curve first: the starting budget comes from it, so it gets the time budget's first share.
        mixed = profiler.mixed(ceilings, decodes, budgets)
        mixed, warnings = profiler.check_and_repair(ceilings, decodes, mixed)
        decode_only = profiler.decode_only(ceilings, batches, mixed)
    except _Stop:
        stopped = True
    finally:
        profiler.cleanup()
        engine.set_tuning(saved_tuning)
        engine.observer = saved_observer
        engine.scheduler.speculative = saved_speculative
    if not mixed and not stopped:
        warnings.append("no mixed point fitted in the time budget")
    cpu_share = None
    if device == "cpu":
        import torch

        wall = max(time.monotonic() - wall_started, 1e-9)
        threads = max(1, torch.get_num_threads())
        cpu_share = (time.process_time() - cpu_started) / wall / threads
        if cpu_share < MIN_CPU_SHARE:
            warnings.append(f"busy machine: the profile ran {cpu_share:.0%} of the time on its {threads} "
                            f"thread(s) (others took the cores)")
    return ProfileRun(Profile(device=device, decode_only=decode_only, mixed=mixed),
                      seconds=time.monotonic() - profiler.started, warnings=warnings, skipped=profiler.skipped,
                      stopped=stopped, cpu_share=cpu_share)


def suggest_token_budget(profile: Profile, tpot_slo_ms: float, ceilings: Ceilings, tuning: Tuning) -> int:
    """The budget a daemon running `tuning` would start with for this TPOT SLO (what /admin/profile suggests)."""
    if not profile.mixed:
        raise ValueError("the profile has no mixed points to choose a budget from")
    return starting_tuning(profile, tpot_slo_ms, ceilings, tuning).token_budget


def starting_tuning(profile: Profile, tpot_slo_ms: float, ceilings: Ceilings, tuning: Tuning,
                    margin: float = SLO_MARGIN) -> Tuning:
    """The tuning a daemon starts with when told its TPOT SLO and no explicit budget: the tuner's start under
    the default bounds (profile_rules.budget_for_tpot, then give_way), so a new replica needs no PUT.
    max_num_seqs gives way to the budget's floor, but not below MIN_STARTING_SEQS."""
    budget = budget_for_tpot(profile, tpot_slo_ms, lo=MIN_TOKEN_BUDGET, hi=ceilings.max_token_budget, margin=margin)
    max_num_seqs = min(tuning.max_num_seqs, ceilings.max_num_seqs)
    budget, max_num_seqs = give_way(budget, max_num_seqs, min(max_num_seqs, MIN_STARTING_SEQS),
                                    ceilings.max_token_budget)
    return Tuning(token_budget=budget, max_num_seqs=max_num_seqs, max_partial_prefills=tuning.max_partial_prefills,
                  long_prefill_threshold=tuning.long_prefill_threshold)
