"""The built-in load of `stallfree up --demo` as it runs: warm-up, calibration, then the sized phases.

The warm-up (the plan's first phase, chat only) runs with SLOs and a chat rate sized from the start-up
profile. When it ends, its control windows calibrate the profile (demo.calibrate), the demo is planned again
from the calibrated profile, its SLOs replace the warm-up's, and the remaining phases start at their
calibrated rates. Every window, the warm-up's too, is judged against those final SLOs.
"""
from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any, Callable

from stallfree.contracts import Profile
from stallfree.operator.control.policy import SLOTargets
from stallfree.operator.local.demo import Calibration, DemoPlan, calibrate, plan_demo, scaled
from stallfree.operator.local.load import LoadDriver, LoadPhase


class DemoRun:
    def __init__(self, runtime: Any, view: Any, profile: Profile, ceiling_budget: int, max_model_len: int,
                 scale: float, load: LoadDriver, stop: asyncio.Event) -> None:
        self.runtime, self.view, self.profile, self.load, self.stop = runtime, view, profile, load, stop
        self.sizing = (ceiling_budget, max_model_len, scale)
        self.plan: DemoPlan = plan_demo(profile, ceiling_budget, max_model_len, scale=scale)
        self.calibration: Calibration | None = None
        self.warmup = self.plan.phases[0]
        self.phases: list[LoadPhase] = [self.warmup]  # the phases the verdict judges (all, once calibrated)
        self.background: list[LoadPhase] = []  # the chat load beside them
        self._first_step = len(runtime.steps)
        self._calibrate_at = time.monotonic() + self.warmup.duration_s
        self._tasks: list[asyncio.Future] = []
        self.use_slos()
        view.say(self.plan.describe() + f"; warm-up '{self.warmup.label}' for {self.warmup.duration_s:.0f}s, "
                 "then the SLOs and loads are sized from the iterations it observed")
        self._start([self._chat(self.warmup.duration_s)], [self.warmup])

    @property
    def duration_s(self) -> float:
        return sum(p.duration_s for p in self.plan.phases)

    def done(self) -> bool:
        return self.calibration is not None and all(t.done() for t in self._tasks)

    def task(self) -> asyncio.Future:
        """Every load task started so far (what a drain waits for)."""
        return asyncio.gather(*self._tasks)

    def tick(self) -> None:
        """After each control step: at the warm-up's end, calibrate, re-plan and start the sized phases."""
        if self.calibration is not None or time.monotonic() < self._calibrate_at or self.stop.is_set():
            return
        windows = [o.stats for step in self.runtime.steps[self._first_step:] for o in step.observations
                   if o.known and o.stats is not None]
        self.calibration = calibrate(windows, self.profile)
        ceiling_budget, max_model_len, scale = self.sizing
        self.plan = plan_demo(scaled(self.profile, self.calibration.factor), ceiling_budget, max_model_len,
                              scale=scale)
        self.use_slos()
        self.view.say(self.calibration.describe())
        self.view.say(self.plan.describe("the calibrated profile"))
        rest = self.plan.phases[1:]
        self.phases += rest
        self._start([self._chat(sum(p.duration_s for p in rest))], rest)

    def use_slos(self) -> None:
        """The plan's SLOs replace the manifest's: sized from this replica's profile, they mean the same anywhere."""
        plan, runtime = self.plan, self.runtime
        slo = SLOTargets(ttft_p99_ms=round(plan.ttft_slo_ms), tpot_p99_ms=round(plan.tpot_slo_ms),
                         queue_wait_p99_ms=round(plan.queue_wait_slo_ms))
        runtime.policy = dataclasses.replace(runtime.policy, slo=slo)
        runtime.loop.policy = runtime.policy
        self.view.policy = runtime.policy

    def _chat(self, duration_s: float) -> LoadPhase:
        chat = dataclasses.replace(self.plan.chat, duration_s=duration_s)
        self.background.append(chat)
        return chat

    def _start(self, background: list[LoadPhase], phases: list[LoadPhase],
               on_phase: Callable[[LoadPhase], None] | None = None) -> None:
        started = self.runtime.started
        self._tasks.append(asyncio.ensure_future(self.load.run(background, started, stop=self.stop)))
        self._tasks.append(asyncio.ensure_future(self.load.run(phases, started, on_phase=on_phase or self.view.phase,
                                                               stop=self.stop)))
