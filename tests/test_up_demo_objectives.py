"""`up --demo`'s batch phase: the plan's flood and objectives, and the verdict per objective (pure)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from stallfree.loadgen.stream import RequestResult
from stallfree.operator.local.demo import (BATCH_FLOOD, BATCH_OBJECTIVE, BATCH_PHASE, CHAT_OBJECTIVE, batch_phase,
                                          demo_objectives, plan_demo)
from stallfree.operator.local.load import LoadPhase, PhasedResult
from stallfree.operator.local.objective_verdict import judge_objective, objective_lines
from stallfree.operator.local.report import objectives_verdict
from stallfree.operator.router.objectives import Objective
from test_up_demo import _profile

CHAT = Objective(CHAT_OBJECTIVE, 10, ttft_ms=1000.0, tpot_ms=100.0)
BATCH = Objective(BATCH_OBJECTIVE, -1, ttft_ms=1000.0, tpot_ms=100.0)


def served(at_s: float = 0.0, ttft_ms: float = 200.0, tpot_ms: float = 50.0) -> RequestResult:
    return RequestResult(0, 32, 10, at_s, ok=True, ttft_ms=ttft_ms, tpot_ms=tpot_ms)


def refused(status: int | None, code: str | None, at_s: float = 0.0, retry_after_s: float | None = 2.0):
    return RequestResult(0, 2000, 8, at_s, error="HTTP ...", status=status, refusal_code=code,
                         retry_after_s=retry_after_s)


def test_the_plan_ends_with_a_sheddable_batch_flood_and_two_objectives():
    plan = plan_demo(_profile(1.0), 512, 2048)
    last = plan.phases[-2]
    assert (last.label, last.objective) == (BATCH_PHASE, BATCH_OBJECTIVE)
    assert [p.label for p in plan.phases if p.objective is None][-1] == "after the batch"
    assert all(p.objective is None for p in plan.phases if p is not last)
    # Sized from the measured capacity: BATCH_FLOOD times what maxReplicas replicas prefill, in long prompts.
    assert batch_phase(plan, 600.0, 2).rate_per_s == pytest.approx(BATCH_FLOOD * 2 * 600.0 / last.prompt_tokens)
    assert batch_phase(plan, None, 3).rate_per_s == pytest.approx(3 * last.rate_per_s)
    objectives = demo_objectives(plan)
    assert objectives.default.name == CHAT_OBJECTIVE and not objectives.default.sheddable
    assert objectives.by_name[BATCH_OBJECTIVE].sheddable
    assert objectives.default.ttft_ms == plan.ttft_slo_ms
    assert objectives.by_name[BATCH_OBJECTIVE].ttft_ms == pytest.approx(plan.ttft_slo_ms / 3)


def test_chat_is_judged_by_its_p99s_and_that_it_was_served_whole():
    ok = judge_objective(CHAT, [served(ttft_ms=100.0 + i) for i in range(100)])
    assert ok.ok and ok.goodput == 1.0
    slow = judge_objective(CHAT, [served()] * 90 + [served(ttft_ms=1500.0)] * 10)
    assert slow.missed == ["p99 TTFT 1500 ms > 1000 ms"] and slow.goodput == pytest.approx(0.9)
    # Client-side TPOT is shown, not judged (the loop's windows judge TPOT on the daemons).
    stalled = judge_objective(CHAT, [served()] * 98 + [served(tpot_ms=150.0)] * 2)
    assert stalled.ok and stalled.p99_tpot_ms == 150.0
    refused_chat = judge_objective(CHAT, [served()] * 99 + [refused(429, "shed_predicted_miss")])
    assert refused_chat.missed == ["1 not served (not sheddable: it should wait)"]


def test_batch_may_be_shed_or_late_but_never_fail_after_waiting_or_be_lost():
    flood = [served(ttft_ms=3000.0)] + [served()] * 3 + [refused(429, "shed_predicted_miss")] * 6
    v = judge_objective(BATCH, flood)
    assert v.ok and (v.served, v.shed) == (4, 6)
    assert v.goodput == pytest.approx(0.3)  # the late one and the sheds did not meet the target
    assert judge_objective(BATCH, flood + [refused(503, "queue_timeout")]).missed == [
        "1 refused after waiting (not at arrival)"]
    assert judge_objective(BATCH, flood + [refused(None, None)]).missed == ["1 lost (neither answered nor refused)"]
    assert judge_objective(BATCH, [refused(429, "shed_predicted_miss", retry_after_s=None)]).missed == [
        "1 shed without Retry-After"]
    assert judge_objective(BATCH, []).missed == ["no request of this objective was sent"]
    assert "MISSED" in " ".join(objective_lines([judge_objective(BATCH, [])], BATCH_PHASE))


def test_the_report_judges_the_chat_sent_during_the_batch_phase_only():
    plan = plan_demo(_profile(1.0), 512, 2048)
    story = {p.label: p for p in plan.phases}
    chat = LoadPhase("chat", 300.0, 1.0, 32, 10)
    batch = story[BATCH_PHASE]
    load = SimpleNamespace(
        phase_starts=[(0.0, story["chat only"]), (0.0, chat), (100.0, story["cool-down"]), (200.0, batch),
                      (260.0, story["after the batch"])],
        results=[PhasedResult("chat", served(150.0, ttft_ms=9e9)),  # before the batch phase: not judged there
                 PhasedResult("chat", served(210.0)), PhasedResult("chat", served(250.0)),
                 PhasedResult("chat", served(270.0, ttft_ms=9e9)),  # after it: not judged there either
                 PhasedResult(BATCH_PHASE, refused(429, "shed_predicted_miss", 205.0), objective=BATCH_OBJECTIVE),
                 PhasedResult(BATCH_PHASE, served(206.0), objective=BATCH_OBJECTIVE)])
    demo = SimpleNamespace(phases=[story["chat only"], story["cool-down"], batch, story["after the batch"]],
                           objectives=demo_objectives(plan))
    verdict = objectives_verdict(load, demo)
    assert verdict["ok"], verdict["lines"]
    figures = {v["objective"]["name"]: v for v in verdict["objectives"]}
    assert (figures["chat"]["requests"], figures["batch"]["requests"], figures["batch"]["shed"]) == (2, 2, 1)
    # A chat request refused in the phase fails the demo.
    load.results.append(PhasedResult("chat", refused(503, "queue_timeout", 220.0)))
    assert not objectives_verdict(load, demo)["ok"]
    # A run without the batch phase (no router) has no verdict per objective.
    load.phase_starts = load.phase_starts[:3]
    assert objectives_verdict(load, demo) is None
