"""The built-in load of `stallfree up --demo` as it runs: warm-up, calibration, then the sized phases.

First one long prompt is prefilled alone at the ceiling budget (a calibration probe: the profile measures short
contexts; a long prompt's chunks attend to their whole prefix). The warm-up (the plan's first phase, chat only)
runs with SLOs and a chat rate sized from the start-up profile. When it ends, its control windows calibrate the
decode-only curve, the slower of them and the probe the mixed curve (demo.calibrate), the demo is planned again
from the calibrated profile, its SLOs replace the warm-up's, and the remaining phases start at their
calibrated rates; the overload phase is sized when it starts, from the prefill capacity the control loop
measured for one replica (demo.beyond_one_replica). Every window, the warm-up's too, is judged against
the final SLOs. Each phase is decided the moment the load driver reaches it (the phase lists are generators).
Behind the router, the router's objectives follow the plan's SLOs (demo.demo_objectives), and the fifth phase
sends a sheddable batch flood beside the chat (sized like the overload, from the measured capacity), the sixth
chat alone again; without a router both are left out.
"""
from __future__ import annotations

import asyncio
import dataclasses
import statistics
from typing import Any, Iterator

from stallfree.contracts import Profile
from stallfree.operator.control.policy import SLOTargets
from stallfree.operator.local.demo import (AFTER_BATCH_PHASE, BATCH_FLOOD, BATCH_PHASE, PHASE_SHARES, Calibration, DemoPlan, batch_phase,
                                          calibrate, demo_objectives, plan_demo, predicted_prefill_ms, scaled, sized_phase)
from stallfree.operator.local.load import LoadDriver, LoadPhase

CAPACITY_STEPS = 3  # the overload phase is sized from the median capacity of the loop's last steps
PROBE_TIMEOUT_S = 120.0
PROBE_PROGRESS_S = 5.0  # a line this often while the probe runs: never silent


class DemoRun:
    def __init__(self, runtime: Any, view: Any, profile: Profile, ceiling_budget: int, max_model_len: int,
                 scale: float, load: LoadDriver, stop: asyncio.Event) -> None:
        self.runtime, self.view, self.profile, self.stop, self.load = runtime, view, profile, stop, load
        self.sizing = (ceiling_budget, max_model_len, scale)
        self.plan: DemoPlan = plan_demo(profile, ceiling_budget, max_model_len, scale=scale)
        self.calibration: Calibration | None = None
        self.warmup = self.plan.phases[0]
        self.phases: list[LoadPhase] = []  # the phases the verdict judges, as they start
        self.background: list[LoadPhase] = []  # the chat load beside them
        self.behind_router = getattr(runtime, "router", None) is not None  # only a router sheds the batch phase
        self._first_step = len(runtime.steps)
        self._long_prompt_factor: float | None = None
        self._tasks: list[asyncio.Future] = []
        self.use_slos()

    async def start(self) -> None:
        """The calibration probe, then the warm-up and the phases (in the background)."""
        await self._probe()
        self.view.say(self.plan.describe() + f"; warm-up '{self.warmup.label}' for {self.warmup.duration_s:.0f}s, "
                      "then the SLOs and loads are sized from the iterations it observed")
        self._first_step = len(self.runtime.steps)
        started, load, stop = self.runtime.started, self.load, self.stop
        self._tasks = [asyncio.ensure_future(load.run(self._chat(), started, stop=stop)),
                       asyncio.ensure_future(load.run(self._story(), started, on_phase=self.view.phase, stop=stop))]

    @property
    def duration_s(self) -> float:
        return sum(p.duration_s for p in self._planned())

    def _planned(self) -> list[LoadPhase]:
        return [p for p in self.plan.phases if self.behind_router or p.label not in (BATCH_PHASE, AFTER_BATCH_PHASE)]

    def done(self) -> bool:
        return bool(self._tasks) and all(t.done() for t in self._tasks)

    def task(self) -> asyncio.Future:
        """Every load task (what a drain waits for)."""
        return asyncio.gather(*self._tasks)

    def use_slos(self) -> None:
        """The plan's SLOs replace the manifest's: sized from this replica's profile, they mean the same anywhere."""
        plan, runtime = self.plan, self.runtime
        slo = SLOTargets(ttft_p99_ms=round(plan.ttft_slo_ms), tpot_p99_ms=round(plan.tpot_slo_ms),
                         queue_wait_p99_ms=round(plan.queue_wait_slo_ms))
        runtime.policy = dataclasses.replace(runtime.policy, slo=slo)
        runtime.loop.policy = runtime.policy
        self.view.policy = runtime.policy
        if self.behind_router:
            runtime.router.set_objectives(demo_objectives(plan))

    @property
    def objectives(self):
        """The router's objectives as the plan sized them (what the verdict per objective judges against)."""
        return demo_objectives(self.plan)

    # -- the phases, each decided when the load driver reaches it ------------------------------------
    def _story(self) -> Iterator[LoadPhase]:
        self.phases.append(self.warmup)
        yield self.warmup
        self._calibrate()
        for phase in self._planned()[1:]:
            if phase.label in PHASE_SHARES or phase.label == BATCH_PHASE:
                phase = self._size_overload(phase)
            self.phases.append(phase)
            yield phase

    def _chat(self) -> Iterator[LoadPhase]:
        for chat in (dataclasses.replace(self.plan.chat, duration_s=self.warmup.duration_s), None):
            if chat is None:
                self._calibrate()
                chat = dataclasses.replace(self.plan.chat, duration_s=self.duration_s - self.warmup.duration_s)
            self.background.append(chat)
            yield chat

    def _calibrate(self) -> None:
        """Once, at the warm-up's end: calibrate from its windows, re-plan, and use the new SLOs."""
        if self.calibration is not None:
            return
        windows = [o.stats for step in self.runtime.steps[self._first_step:] for o in step.observations
                   if o.known and o.stats is not None]
        self.calibration = calibrate(windows, self.profile, self._long_prompt_factor)
        ceiling_budget, max_model_len, scale = self.sizing
        cal = self.calibration
        self.plan = plan_demo(scaled(self.profile, cal.factor, cal.prefill_factor), ceiling_budget, max_model_len,
                              scale=scale)
        self.use_slos()
        self.view.say(self.calibration.describe())
        self.view.say(self.plan.describe("the calibrated profile"))

    async def _probe(self) -> None:
        """One long prompt alone at the ceiling budget: its TTFT over the profile's prediction for its chunks."""
        ceiling_budget = self.sizing[0]
        probe = LoadPhase("calibration probe", 0.0, 0.0, self.plan.long_prompt_tokens, 1)
        self.view.say(f"calibration probe: one {probe.prompt_tokens}-token prompt prefilled alone")
        task = asyncio.ensure_future(self.load.alone(probe, self.runtime.started))
        waited = 0.0
        while not task.done():
            await asyncio.wait([task], timeout=PROBE_PROGRESS_S)
            waited += PROBE_PROGRESS_S
            if task.done():
                break
            if waited >= PROBE_TIMEOUT_S or self.stop.is_set():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                self.view.say(f"calibration probe: no answer after {waited:.0f}s; the warm-up alone calibrates")
                return
            self.view.say(f"calibration probe: still prefilling ({waited:.0f}s)")
        result = task.result()
        predicted = predicted_prefill_ms(self.profile, probe.prompt_tokens, ceiling_budget)
        if not result.ok or not result.ttft_ms or predicted <= 0:
            self.view.say(f"calibration probe failed ({result.error}); the warm-up alone calibrates")
            return
        self._long_prompt_factor = result.ttft_ms / predicted
        self.view.say(f"calibration probe: prefilled in {result.ttft_ms:.0f} ms, the profile predicts "
                      f"{predicted:.0f} ms at budget {ceiling_budget} (x{self._long_prompt_factor:.2f})")

    def _size_overload(self, planned: LoadPhase) -> LoadPhase:
        measured = [s.feasibility.capacity_tokens_per_s for s in self.runtime.steps[-CAPACITY_STEPS:]
                    if getattr(s, "feasibility", None) is not None and s.feasibility.capacity_tokens_per_s]
        capacity = statistics.median(measured) if measured else None
        batch = planned.label == BATCH_PHASE
        max_replicas = self.runtime.spec.scaling.max_replicas
        phase = (batch_phase(self.plan, capacity, max_replicas) if batch
                 else sized_phase(self.plan, planned.label, capacity))
        if capacity is None:
            self.view.say(f"no measured prefill capacity yet: '{planned.label}' keeps the plan's rate")
        else:
            kind = f"sheddable batch (objective `batch`, {max_replicas} replicas' worth x{BATCH_FLOOD:g})" if batch \
                else "long-prompt"
            self.view.say(f"the loop measured one replica prefilling ~{capacity:.0f} tokens/s at the budget its "
                          f"TPOT target allows: '{phase.label}' asks {phase.rate_per_s * phase.prompt_tokens:.0f} "
                          f"{kind} tokens/s plus the chat")
        return phase
