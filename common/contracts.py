"""Contracts shared by the operator and the node daemon.

Dependency-free on purpose: the operator imports this without torch, and the daemon serialises
these exact shapes on /admin/tuning, /admin/stats and /admin/profile. Nothing here is defined twice.
"""
from __future__ import annotations

import math
from bisect import bisect_left
from dataclasses import asdict, dataclass, field, fields
from functools import cached_property
from typing import Any, Iterable, Sequence

# A budget must leave real room for prefill after every running decode took its one token.
MIN_PREFILL_HEADROOM_TOKENS = 32


class TuningError(ValueError):
    """A tuning request that the engine must refuse (names the offending field)."""


@dataclass(frozen=True)
class Ceilings:
    """Fixed at engine start: they size buffers (and CUDA graphs). Live knobs move below them."""

    max_token_budget: int = 2048
    max_num_seqs: int = 256


@dataclass(frozen=True)
class Tuning:
    """The live knobs of one engine; a PUT to /admin/tuning replaces them at the next iteration."""

    token_budget: int = 512
    max_num_seqs: int = 64
    max_partial_prefills: int = 1
    # Most prefill tokens one request may take in an iteration while others wait (0 = no cap).
    long_prefill_threshold: int = 0

    def to_dict(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any], base: "Tuning | None" = None) -> "Tuning":
        """Build from a (possibly partial) dict; missing keys keep `base`'s values."""
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise TuningError(f"unknown tuning field(s): {', '.join(sorted(unknown))}")
        merged = (base or cls()).to_dict()
        for key, value in data.items():
            if isinstance(value, bool) or not isinstance(value, int):
                raise TuningError(f"{key} must be an integer, got {value!r}")
            merged[key] = value
        return cls(**merged)


def min_budget_for(max_num_seqs: int) -> int:
    """Smallest token budget that still leaves prefill room beside max_num_seqs decodes."""
    return max_num_seqs + max(MIN_PREFILL_HEADROOM_TOKENS, max_num_seqs // 4)


def validate_tuning(tuning: Tuning, ceilings: Ceilings) -> None:
    """Raise TuningError naming the first problem; a valid tuning returns None."""
    if tuning.max_num_seqs < 1:
        raise TuningError("max_num_seqs must be at least 1")
    if tuning.max_num_seqs > ceilings.max_num_seqs:
        raise TuningError(f"max_num_seqs {tuning.max_num_seqs} exceeds its ceiling {ceilings.max_num_seqs}")
    if tuning.token_budget > ceilings.max_token_budget:
        raise TuningError(f"token_budget {tuning.token_budget} exceeds its ceiling {ceilings.max_token_budget}")
    floor = min_budget_for(tuning.max_num_seqs)
    if tuning.token_budget < floor:
        raise TuningError(
            f"token_budget {tuning.token_budget} leaves no prefill room beside max_num_seqs "
            f"{tuning.max_num_seqs}: it must be at least {floor}"
        )
    if tuning.max_partial_prefills < 1:
        raise TuningError("max_partial_prefills must be at least 1")
    if tuning.long_prefill_threshold < 0:
        raise TuningError("long_prefill_threshold must be 0 (no cap) or positive")


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """The exact nearest-rank percentile of already sorted values; q is a fraction in [0, 1] (0.99 for p99).

    Nearest rank, not interpolation: a p99 is a latency some request really saw. Every percentile in the
    project (the stats window, the simulator's judge, the benchmarks) is this one."""
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"q is a fraction in [0, 1], got {q}")
    if len(sorted_values) == 0:
        raise ValueError("percentile of no samples")
    return sorted_values[max(0, math.ceil(q * len(sorted_values)) - 1)]


@dataclass(frozen=True)
class Percentiles:
    """Exact percentiles over the samples of one window, in milliseconds."""

    count: int = 0
    p50: float | None = None
    p90: float | None = None
    p99: float | None = None
    max: float | None = None


@dataclass(frozen=True)
class WindowStats:
    """What /admin/stats returns: one replica's view of its last `window_s` seconds."""

    window_s: float
    ttft_ms: Percentiles
    tpot_ms: Percentiles
    itl_ms: Percentiles
    queue_wait_ms: Percentiles
    request_rate: float  # finished requests per second
    prompt_tokens_per_s: float  # prompt tokens arriving per second (demand)
    generation_tokens_per_s: float
    prefill_tokens_per_s: float  # prefill tokens computed per second (work done)
    decode_tokens_per_s: float
    budget_utilisation: float  # mean scheduled tokens / budget over busy iterations
    kv_usage: float  # 0..1
    preemptions: int  # within the window
    num_waiting: int
    num_running: int
    tuning: Tuning
    ceilings: Ceilings
    iterations: int = 0
    mean_iteration_ms: float | None = None
    # Live, for the router: accepted prompt tokens without a first token yet, and the whole KV cache's size.
    queued_prompt_tokens: int = 0
    kv_capacity_tokens: int = 0
    # What the replica serves on a slower path than its compiled forward over the model's codes (empty: none).
    slow_paths: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "WindowStats":
        data = dict(data)
        for key in ("ttft_ms", "tpot_ms", "itl_ms", "queue_wait_ms"):
            data[key] = Percentiles(**data[key])
        data["tuning"] = Tuning(**data["tuning"])
        data["ceilings"] = Ceilings(**data["ceilings"])
        data["slow_paths"] = tuple(data.get("slow_paths", ()))
        return cls(**data)


@dataclass(frozen=True)
class Curve:
    """y against x, piecewise linear through measured points: every prediction made from a profile.

    The end rule:
    - between two points: the straight line through them;
    - at or below the first point: the first point's y (fewer tokens than the smallest measured never
      cost less: an iteration's fixed part dominates there);
    - past the last point: along the last segment, from the origin to the point when there is only
      one (cost grows as it last grew), and never below zero.
    """

    xs: tuple[float, ...]
    ys: tuple[float, ...]

    @classmethod
    def through(cls, points: Iterable[tuple[float, float]]) -> "Curve":
        """The curve through (x, y) points in any order; of points sharing an x, the first is kept."""
        xs: list[float] = []
        ys: list[float] = []
        for x, y in sorted(points, key=lambda point: point[0]):
            if not xs or x > xs[-1]:
                xs.append(x)
                ys.append(y)
        if not xs:
            raise ValueError("a curve needs at least one point")
        return cls(tuple(xs), tuple(ys))

    def at(self, x: float) -> float:
        xs, ys = self.xs, self.ys
        if x <= xs[0]:
            return ys[0]
        i = bisect_left(xs, x)  # xs[i - 1] < x <= xs[i]
        if i < len(xs):
            x0, y0 = xs[i - 1], ys[i - 1]
            return y0 + (x - x0) / (xs[i] - x0) * (ys[i] - y0)
        x0, y0 = (xs[-2], ys[-2]) if len(xs) > 1 else (0.0, 0.0)
        slope = (ys[-1] - y0) / (xs[-1] - x0) if xs[-1] > x0 else 0.0
        return max(0.0, ys[-1] + slope * (x - xs[-1]))

    def largest_point_within(self, bound: float) -> float | None:
        """The largest measured x whose y is within the bound; None when no point is."""
        fitting = [x for x, y in zip(self.xs, self.ys) if y <= bound]
        return fitting[-1] if fitting else None

    def largest_x_within(self, bound: float, lo: int, hi: int) -> int | None:
        """The largest integer x in [lo, hi] with at(x) <= bound; None when there is none.

        Exact on any curve, monotone or not: each piece (past the last point, each segment, at or below
        the first point) is linear, so monotone; the pieces are searched from the right."""
        if lo > hi:
            return None
        edges = [math.floor(x) for x in self.xs]
        pieces = [(edges[-1] + 1, hi)]
        pieces += [(edges[i - 1] + 1, edges[i]) for i in range(len(edges) - 1, 0, -1)]
        pieces.append((lo, edges[0]))
        for left, right in pieces:
            left, right = max(left, lo), min(right, hi)
            if left > right:
                continue
            if self.at(right) <= bound:
                return right
            if self.at(left) > bound:
                continue  # nothing on this piece fits
            fits, over = left, right  # rising here: bisect for the last x that fits
            while over - fits > 1:
                mid = (fits + over) // 2
                if self.at(mid) <= bound:
                    fits = mid
                else:
                    over = mid
            return fits
        return None


@dataclass(frozen=True)
class ProfilePoint:
    """One measured (or predicted) iteration: how long `tokens` took with `num_decodes` of them decodes."""

    tokens: int
    num_decodes: int
    iteration_ms: float


@dataclass(frozen=True)
class Profile:
    """Iteration time against tokens per iteration on one device (what /admin/profile returns)."""

    device: str
    decode_only: list[ProfilePoint] = field(default_factory=list)
    mixed: list[ProfilePoint] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Profile":
        return cls(
            device=data["device"],
            decode_only=[ProfilePoint(**p) for p in data.get("decode_only", [])],
            mixed=[ProfilePoint(**p) for p in data.get("mixed", [])],
        )

    # Built once per profile (the fields are never changed after it is made; the scheduler reads these per step).
    @cached_property
    def mixed_curve(self) -> Curve:
        """Iteration time against tokens per iteration (the mixed points)."""
        if not self.mixed:
            raise ValueError("profile has no mixed points")
        return Curve.through((p.tokens, p.iteration_ms) for p in self.mixed)

    @cached_property
    def decode_curve(self) -> Curve:
        """Decode-only iteration time against decodes in the batch; the mixed curve without decode-only points."""
        if not self.decode_only:
            return self.mixed_curve
        return Curve.through((p.num_decodes, p.iteration_ms) for p in self.decode_only)

    def iteration_ms_at(self, tokens: float) -> float:
        """An iteration of `tokens` tokens, on the mixed curve (Curve's end rule)."""
        return self.mixed_curve.at(tokens)

    def decode_ms_at(self, num_decodes: float) -> float:
        """The decode-only iteration for a batch of `num_decodes` (Curve's end rule); without decode-only
        points, the mixed curve at that many tokens."""
        return self.decode_curve.at(num_decodes)
