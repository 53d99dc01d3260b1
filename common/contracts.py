"""Contracts shared by the operator and the node daemon.

Dependency-free on purpose: the operator imports this without torch, and the daemon serialises
these exact shapes on /admin/tuning, /admin/stats and /admin/profile. Nothing here is defined twice.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

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

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "WindowStats":
        data = dict(data)
        for key in ("ttft_ms", "tpot_ms", "itl_ms", "queue_wait_ms"):
            data[key] = Percentiles(**data[key])
        data["tuning"] = Tuning(**data["tuning"])
        data["ceilings"] = Ceilings(**data["ceilings"])
        return cls(**data)


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

    def iteration_ms_at(self, tokens: int) -> float:
        """Linear interpolation over the mixed curve (clamped extrapolation at the ends)."""
        points = sorted(self.mixed, key=lambda p: p.tokens)
        if not points:
            raise ValueError("profile has no mixed points")
        if tokens <= points[0].tokens:
            return points[0].iteration_ms
        for lo, hi in zip(points, points[1:]):
            if tokens <= hi.tokens:
                frac = (tokens - lo.tokens) / max(1, hi.tokens - lo.tokens)
                return lo.iteration_ms + frac * (hi.iteration_ms - lo.iteration_ms)
        lo, hi = points[-2:] if len(points) > 1 else (points[0], points[0])
        slope = (hi.iteration_ms - lo.iteration_ms) / max(1, hi.tokens - lo.tokens)
        return hi.iteration_ms + slope * (tokens - hi.tokens)

    def decode_ms_at(self, num_decodes: int) -> float:
        """The decode-only iteration for a batch of `num_decodes` (linear between points, along the end
        segment beyond them); without decode-only points, the mixed curve at that many tokens."""
        points = sorted((p.num_decodes, p.iteration_ms) for p in self.decode_only)
        if not points:
            return self.iteration_ms_at(num_decodes)
        if num_decodes <= points[0][0]:
            return points[0][1]
        for (n0, ms0), (n1, ms1) in zip(points, points[1:]):
            if num_decodes <= n1:
                return ms0 + (num_decodes - n0) / max(1, n1 - n0) * (ms1 - ms0)
        (n0, ms0), (n1, ms1) = points[-2:] if len(points) > 1 else (points[0], points[0])
        return ms1 + (ms1 - ms0) / max(1, n1 - n0) * (num_decodes - n1)

    def budget_for(self, iteration_target_ms: float, lo: int = 1, hi: int = 1 << 16) -> int:
        """Sarathi-Serve's recipe: the largest token budget whose iteration time fits the target."""
        best = None
        for point in sorted(self.mixed, key=lambda p: p.tokens):
            if point.iteration_ms <= iteration_target_ms:
                best = point.tokens
        if best is None:
            best = min(p.tokens for p in self.mixed)
        return max(lo, min(hi, best))
