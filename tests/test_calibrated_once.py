"""A profile is calibrated once: by the speed the control loop learned, never again by the newest window.

The loop scales each replica's profile by the moving average of observed-over-predicted windows. Feasibility
and the tuner take that profile as it is; were they to divide it by the newest window's ratio again, the average
would be undone and only that window would speak (one fast window after a slow one would read as full speed).
"""
from __future__ import annotations

from dataclasses import replace

from control_helpers import observation, pct, stats
from stallfree.contracts import Ceilings, Profile, ProfilePoint, Tuning
from stallfree.operator.control.loop import ControlLoop
from stallfree.operator.control.observe import ReplicaTarget
from stallfree.operator.control.policy import ControlPolicy, SLOTargets

PROFILE = Profile("test", decode_only=[ProfilePoint(1, 1, 10.0), ProfilePoint(16, 16, 12.0)],
                  mixed=[ProfilePoint(64, 16, 20.0), ProfilePoint(512, 16, 60.0)])
POLICY = ControlPolicy(slo=SLOTargets(tpot_p99_ms=100.0))


def decode_window(slowdown: float):
    """Iterations of 16 decodes each, `slowdown` x the profile's decode-only time for 16."""
    iteration_ms = slowdown * PROFILE.decode_ms_at(16)
    window = stats(budget=256, seqs=16, utilisation=16 / 256, prefill_rate=0.0, prompt_rate=0.0, decode_rate=1000.0,
                   running=16, mean_iteration_ms=iteration_ms, ceilings=Ceilings(2048, 256))
    return replace(window, tpot_ms=pct(iteration_ms), tuning=Tuning(256, 16))


class ScriptedObserver:
    """Hands the loop one prepared window per step (the replica's /admin/stats and /admin/profile)."""

    def __init__(self, windows) -> None:
        self.windows = list(windows)

    async def observe(self, targets, now):
        return [observation("r0", self.windows.pop(0), PROFILE)]


class Recorder:
    async def put_tuning(self, replica, tuning) -> None:
        pass

    async def set_replicas(self, replicas) -> None:
        pass

    async def record_event(self, reason, message, warning=False) -> None:
        pass


async def test_feasibility_sees_the_learned_speed_not_only_the_newest_window():
    loop = ControlLoop(POLICY, ScriptedObserver([decode_window(2.0), decode_window(1.0)]), Recorder())
    await loop.step([ReplicaTarget("r0")], 1, now=0.0)
    result = await loop.step([ReplicaTarget("r0")], 1, now=30.0)
    learned = loop.state.speeds["r0"].decode
    assert abs(learned - 1.5) < 1e-9  # half the newest window (x1.0), half what was learned (x2.0)
    # The TPOT floor is the decode-only step at one sequence on the profile as learned: x1.5, not x1.0.
    assert abs(result.feasibility.tpot_floor_ms - 1.5 * PROFILE.decode_ms_at(1)) < 1e-9
