"""A replica's true speed against the profile the control loop reads (the profile can be wrong).

On a real machine the start-up profile is measured once, alone, on short contexts; then a noisy
neighbour arrives, the node is another GPU model than the profile's cache key said, or the profile
was simply optimistic. `SlowedCostModel` advances a virtual replica's clock at `speed` times the
profile's rate (0.7: every iteration takes 1/0.7 of the predicted time) while its /admin/profile
still answers the nominal curve, so the loop must learn the truth from observed windows.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from stallfree.node_daemon.sim.cost_model import IterationCostModel
from stallfree.node_daemon.sim.sim_executor import VirtualClock


@dataclass(frozen=True)
class SpeedSchedule:
    """True speed over the profile's: `factor` from the start, `factor_after` from `change_at_s` on."""

    factor: float = 1.0
    change_at_s: float | None = None
    factor_after: float = 1.0

    def __post_init__(self) -> None:
        if self.factor <= 0 or self.factor_after <= 0:
            raise ValueError("a speed factor must be positive")

    def at(self, t: float) -> float:
        return self.factor_after if self.change_at_s is not None and t >= self.change_at_s else self.factor

    @property
    def nominal(self) -> bool:
        return self.factor == 1.0 and (self.change_at_s is None or self.factor_after == 1.0)

    def describe(self) -> str:
        text = f"x{self.factor:g}"
        if self.change_at_s is not None:
            text += f", x{self.factor_after:g} from t={self.change_at_s:g}s"
        return text


class SlowedCostModel:
    """The inner cost model's time divided by the schedule's speed at the clock's time."""

    def __init__(self, inner: IterationCostModel, schedule: SpeedSchedule, clock: VirtualClock) -> None:
        self.inner = inner
        self.schedule = schedule
        self.clock = clock

    def predict_ms(self, decode_context_lens: Sequence[int], prefill_chunks: Sequence[tuple[int, int]]) -> float:
        return self.inner.predict_ms(decode_context_lens, prefill_chunks) / self.schedule.at(self.clock.now)
