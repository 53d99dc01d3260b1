"""The `up --demo` plan (sized from a profile) and its verdict (pure functions over timeline rows)."""
from __future__ import annotations

from stallfree.contracts import Ceilings, Percentiles, Profile, ProfilePoint, Tuning, WindowStats
from stallfree.operator.local.demo import (BEYOND_ONE_REPLICA, beyond_one_replica, calibrate, p99_tpot_beside_prefill,
                                          plan_demo, predicted_iteration_ms, predicted_prefill_ms, scaled)
from stallfree.operator.local.verdict import Phase, judge, verdict_text


def _profile(scale: float) -> Profile:
    """Iteration time 10 ms + 2 ms/token on the mixed curve, decode 8 ms + 1 ms/seq; `scale` x slower."""
    mixed = [ProfilePoint(t, 0, scale * (10 + 2 * t)) for t in (16, 64, 128, 256, 512)]
    decode = [ProfilePoint(n, n, scale * (8 + n)) for n in (1, 4, 16, 32)]
    return Profile("cpu", decode_only=decode, mixed=mixed)


def test_the_plan_scales_with_the_machine():
    fast, slow = plan_demo(_profile(1.0), 512, 2048), plan_demo(_profile(3.0), 512, 2048)
    assert slow.tpot_slo_ms == 3.0 * fast.tpot_slo_ms
    assert slow.allowed_budget == fast.allowed_budget
    assert abs(slow.chat.rate_per_s * 3.0 - fast.chat.rate_per_s) < 1e-9
    for f, s in zip(fast.phases, slow.phases):
        assert abs(s.rate_per_s * 3.0 - f.rate_per_s) < 1e-9


def test_the_plan_makes_the_ceiling_budget_breach_and_leaves_room_below():
    plan = plan_demo(_profile(1.0), 512, 2048)
    profile = _profile(1.0)
    # A reply decoding when a long prompt starts: at the ceiling budget its TPOT breaks the SLO clearly, at the
    # budget the SLO allows it fits (p99 TPOT is a per-request mean: replies are short enough to feel it).
    assert p99_tpot_beside_prefill(profile, 512, plan.long_prompt_tokens) > 1.3 * plan.tpot_slo_ms
    assert p99_tpot_beside_prefill(profile, plan.allowed_budget, plan.long_prompt_tokens) <= plan.tpot_slo_ms
    assert p99_tpot_beside_prefill(profile, 512, plan.long_prompt_tokens, output_tokens=64) < plan.tpot_slo_ms
    assert profile.iteration_ms_at(plan.allowed_budget) <= 0.8 * plan.tpot_slo_ms
    assert 64 <= plan.allowed_budget < 512
    long_rates = {p.label: p.rate_per_s for p in plan.phases}
    capacity = plan.prefill_tokens_per_s / plan.long_prompt_tokens
    chat = plan.chat.rate_per_s * plan.chat.prompt_tokens / plan.long_prompt_tokens
    assert long_rates["long prompts"] + chat < 0.75 * capacity < long_rates["beyond one replica"] + chat


def _row(t, tpot, queue=100.0, ttft=200.0, budget=512, replicas=1):
    return {"t": t, "replicas": replicas, "desired_replicas": replicas, "p99_tpot_ms": tpot,
            "p99_queue_wait_ms": queue, "p99_ttft_ms": ttft,
            "replica_detail": [{"name": "r0", "known": tpot is not None, "token_budget": budget}]}


SLOS = {"tpot": 100.0, "queue_wait": 1000.0, "ttft": 2000.0}


def test_a_breach_restored_counts_intervals_and_the_budget_path():
    rows = [_row(0, 50), _row(5, 300), _row(10, None, budget=256), _row(15, 150, budget=128), _row(20, 80, budget=128),
            _row(25, 70, budget=128), _row(30, 60, budget=128)]
    verdict = judge(rows, [Phase("chat", 0, 5), Phase("long", 5, 40)], SLOS)
    chat, long = verdict.phases
    assert chat.breaches == []
    (breach,) = long.breaches
    assert (breach.slo, breach.at_s, breach.restored_at_s, breach.intervals_to_restore) == ("tpot", 5, 20, 3)
    assert breach.worst_ms == 300
    assert long.budget_path == [512, 256, 128]
    assert verdict.ok and verdict.met_at_end["tpot"] is True
    assert any("back under after 3 interval(s)" in line for line in verdict_text(verdict, 5))


def test_an_unrestored_feasible_breach_fails_and_an_infeasible_one_does_not():
    rows = [_row(0, 50), _row(5, 300), _row(10, 320), _row(15, 310)]
    verdict = judge(rows, [Phase("long", 0, 20)], SLOS)
    assert not verdict.ok and len(verdict.failed) == 1
    assert verdict.met_at_end["tpot"] is False
    excused = judge(rows, [Phase("long", 0, 20)], SLOS, infeasible={"tpot": "decode step 400 ms > SLO"})
    assert excused.ok and excused.failed == []
    assert any("SLOFeasible=False" in line for line in verdict_text(excused, 5))


def _judged(rows, *judgements):
    """The loop's judgement per step (SLO names judged infeasible; None: it could not judge)."""
    return [dict(r, infeasible=j) for r, j in zip(rows, judgements)]


def test_an_unrestored_breach_is_excused_only_if_the_loop_judged_it_infeasible_at_the_end():
    rows = [_row(0, 50), _row(5, 300), _row(10, 320), _row(15, 310), _row(20, 330)]
    messages = {"tpot": "at budget 64 the p99 TPOT would be 296 ms"}
    # Judged infeasible for a while, feasible again by the end, still breached: a failure of the loop.
    flip = judge(_judged(rows, [], ["tpot"], ["tpot"], [], []), [Phase("long", 0, 30)], SLOS, infeasible=messages)
    assert not flip.ok and len(flip.failed) == 1 and flip.infeasible == {}
    assert any("for a while" in line for line in verdict_text(flip, 5))
    # Judged infeasible at the last step that could judge (an unknown last step does not change it): excused.
    end = judge(_judged(rows, [], [], ["tpot"], ["tpot"], None), [Phase("long", 0, 30)], SLOS, infeasible=messages)
    assert end.ok and end.failed == [] and "tpot" in end.infeasible
    assert any("SLOFeasible=False for TPOT (to the end)" in line for line in verdict_text(end, 5))


def test_a_breach_that_lasts_into_the_next_phase_is_counted_once():
    rows = [_row(0, 50), _row(5, 300), _row(10, 320), _row(15, 310), _row(20, 80), _row(25, 70), _row(30, 60)]
    verdict = judge(rows, [Phase("long", 0, 12), Phase("cool-down", 12, 40)], SLOS)
    long, cool = verdict.phases
    assert len(long.breaches) == 1 and long.breaches[0].restored_at_s == 20
    assert cool.breaches == [] and [b.at_s for b in cool.carried] == [5]
    assert verdict.ok
    assert any("the breach from 5s goes on (back under at 20s)" in line for line in verdict_text(verdict, 5))


def _chat_window(slowdown: float, budget: int = 512, iterations: int = 500) -> WindowStats:
    """A chat window: ~5 decodes per iteration and a 64-token prompt every ~20 iterations, `slowdown` x the
    profile's time for what its iterations carried."""
    decode_tps, prefill_tps = 125.0, 80.0  # per second; 25 iterations/s
    tokens = (decode_tps + prefill_tps) / 25.0
    share = decode_tps / (decode_tps + prefill_tps)
    mean_ms = slowdown * predicted_iteration_ms(_profile(1.0), share * tokens, (1 - share) * tokens)
    p = Percentiles(20, 10.0, 20.0, 30.0, 40.0)
    return WindowStats(window_s=20, ttft_ms=p, tpot_ms=p, itl_ms=p, queue_wait_ms=p, request_rate=1.2,
                       prompt_tokens_per_s=prefill_tps, generation_tokens_per_s=decode_tps,
                       prefill_tokens_per_s=prefill_tps, decode_tokens_per_s=decode_tps,
                       budget_utilisation=tokens / budget, kv_usage=0.05, preemptions=0, num_waiting=0, num_running=5,
                       tuning=Tuning(budget, 16), ceilings=Ceilings(512, 32), iterations=iterations,
                       mean_iteration_ms=mean_ms)


def test_the_warm_up_calibrates_the_profile_by_what_its_iterations_took():
    profile = _profile(1.0)
    cal = calibrate([_chat_window(1.6), _chat_window(1.8), _chat_window(1.7), _chat_window(5.0, iterations=3)],
                    profile)
    assert cal.windows == 3 and abs(cal.factor - 1.7) < 1e-9 and [round(x, 6) for x in cal.spread] == [1.6, 1.8]
    assert "x1.70" in cal.describe()
    assert calibrate([], profile).factor == 1.0 and "start-up profile stands" in calibrate([], profile).describe()
    # The demo planned from the calibrated profile is the demo of a machine 1.7x slower.
    planned = plan_demo(scaled(profile, cal.factor), 512, 2048)
    slow = plan_demo(_profile(1.7), 512, 2048)
    assert abs(planned.tpot_slo_ms - slow.tpot_slo_ms) < 1e-9
    assert abs(planned.phases[2].rate_per_s - slow.phases[2].rate_per_s) < 1e-12


def test_the_overload_is_sized_beyond_the_capacity_the_loop_measured():
    plan = plan_demo(_profile(1.0), 512, 2048)
    measured = 0.6 * plan.prefill_tokens_per_s  # a replica beside chat and other work prefills less
    phase = beyond_one_replica(plan, measured)
    demand = phase.rate_per_s * phase.prompt_tokens + plan.chat.rate_per_s * plan.chat.prompt_tokens
    assert abs(demand - BEYOND_ONE_REPLICA * measured) < 1e-6
    assert measured < demand < 2 * 0.8 * measured  # one replica cannot, two a fifth slower each can
    assert beyond_one_replica(plan, None) == next(p for p in plan.phases if p.label == "beyond one replica")


def test_the_long_prompt_phase_is_sized_within_one_replica_from_the_same_figure():
    from stallfree.operator.local.demo import WITHIN_ONE_REPLICA, sized_phase

    plan = plan_demo(_profile(1.0), 512, 2048)
    measured = 0.6 * plan.prefill_tokens_per_s
    long = sized_phase(plan, "long prompts", measured)
    beyond = sized_phase(plan, "beyond one replica", measured)
    chat = plan.chat.rate_per_s * plan.chat.prompt_tokens
    assert abs(long.rate_per_s * long.prompt_tokens + chat - WITHIN_ONE_REPLICA * measured) < 1e-6
    assert long.rate_per_s * long.prompt_tokens + chat < measured  # one replica holds it: no second one yet
    assert beyond.rate_per_s * beyond.prompt_tokens + chat > measured  # the next phase needs the second
    assert sized_phase(plan, "long prompts", None) == next(p for p in plan.phases if p.label == "long prompts")


def test_a_window_with_an_unknown_replica_does_not_restore_an_slo():
    rows = [_row(0, 50), _row(5, 300), _row(10, 80), _row(15, 90), _row(20, 70), _row(25, 60)]
    rows[2]["replica_detail"].append({"name": "r1", "known": False})  # only r0 known: its 80 ms says too little
    (breach,) = judge(rows, [Phase("long", 0, 30)], SLOS).phases[0].breaches
    assert breach.restored_at_s == 15 and breach.intervals_to_restore == 2


def test_a_long_prompt_probe_calibrates_the_mixed_curve_when_it_ran_slower_than_chat():
    profile = _profile(1.0)
    # 1200 tokens at budget 512: two full chunks and one of 176.
    assert predicted_prefill_ms(profile, 1200, 512) == 2 * (10 + 2 * 512) + (10 + 2 * 176)
    cal = calibrate([_chat_window(1.2)] * 3, profile, long_prompt_factor=2.5)
    assert abs(cal.factor - 1.2) < 1e-9 and cal.prefill_factor == 2.5 and "x2.50" in cal.describe()
    assert calibrate([_chat_window(1.2)] * 3, profile, long_prompt_factor=0.9).prefill_factor == cal.factor
    slow_chunks = scaled(profile, cal.factor, cal.prefill_factor)
    assert slow_chunks.iteration_ms_at(128) == 2.5 * profile.iteration_ms_at(128)
    assert slow_chunks.decode_only[0].iteration_ms == 1.2 * profile.decode_only[0].iteration_ms
    # Sized from it, the long-prompt load is what one replica prefills at those chunks' speed.
    assert plan_demo(slow_chunks, 512, 2048).prefill_tokens_per_s < plan_demo(scaled(profile, 1.2), 512,
                                                                             2048).prefill_tokens_per_s / 2


def test_an_idle_replica_read_with_nothing_waiting_does_not_hold_back_a_restore():
    # After a scale-out light load may leave one replica idle: read, nothing waiting, too few samples to judge.
    rows = [_row(0, 50), _row(5, 300), _row(10, 80), _row(15, 90)]
    for row in rows[2:]:
        row["replica_detail"].append({"name": "r1", "known": False, "num_waiting": 0})
    rows[2]["replica_detail"][1]["num_waiting"] = 2  # something waits there: it says too little to restore
    (breach,) = judge(rows, [Phase("long", 0, 20)], SLOS).phases[0].breaches
    assert breach.restored_at_s == 15 and breach.intervals_to_restore == 2
