"""Latency summaries shared by the simulator and the benchmark client: exact percentiles and goodput."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from stallfree.contracts import percentile
from stallfree.latency import within_targets


def summarize(values: Iterable[float]) -> dict[str, float | int | None]:
    """count, mean, p50, p90, p99, max of the values (None where there are none)."""
    ordered = sorted(values)
    if not ordered:
        return {"count": 0, "mean": None, "p50": None, "p90": None, "p99": None, "max": None}
    return {
        "count": len(ordered),
        "mean": sum(ordered) / len(ordered),
        "p50": percentile(ordered, 0.50),
        "p90": percentile(ordered, 0.90),
        "p99": percentile(ordered, 0.99),
        "max": ordered[-1],
    }


@dataclass(frozen=True)
class SLOs:
    """Per-request latency objectives in milliseconds (None: not judged)."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None

    def met(self, ttft_ms: float | None, tpot_ms: float | None, e2e_ms: float | None) -> bool:
        if not within_targets(ttft_ms, tpot_ms, ttft_target_ms=self.ttft_ms, tpot_target_ms=self.tpot_ms):
            return False
        return not (self.e2e_ms is not None and (e2e_ms is None or e2e_ms > self.e2e_ms))

    def to_dict(self) -> dict[str, float | None]:
        return {"ttft_ms": self.ttft_ms, "tpot_ms": self.tpot_ms, "e2e_ms": self.e2e_ms}
