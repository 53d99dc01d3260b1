"""The built-in load of `stallfree up --demo`, and its SLOs, sized from the replica's own measured profile.

Every rate and latency is a multiple of what this replica measured (calibrated by the chat-only warm-up), so the
demo means the same on a fast machine and a slow one. docs/control-loop.md tells its six phases. Behind the
router it serves two objectives: chat (the default, priority 10) and batch (priority -1: sheddable), whose
requests come only in the fifth phase, beside the chat.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, replace
from typing import Sequence

from stallfree.contracts import Profile, WindowStats
from stallfree.profile_rules import (MIN_TOKEN_BUDGET, SLO_MARGIN, budget_for_tpot, prefill_room, prefill_tokens_per_s,
                                     scaled)
from stallfree.operator.local.load import LoadPhase
from stallfree.operator.router.objectives import Objective, Objectives

# p99 TPOT is a per-request mean: a reply decodes beside a long prompt's prefill for as many iterations as that
# prefill lasts. Replies shorter than a long prompt's chunk count at the allowed budget decode wholly beside it
# (TPOT ~ the budget's iteration, which the budget controls); at the ceiling budget the few huge iterations
# still dominate such a short reply. Longer replies would average the stall away (see p99_tpot_beside_prefill).
CHAT_PROMPT_TOKENS = 32
CHAT_OUTPUT_TOKENS = 10
LONG_OUTPUT_TOKENS = 8
CHAT_STREAMS = 4  # chat requests decoding at once on one replica, by Little's law (an upper bound)
CHAT_SHARE = 0.2  # of one replica's prefill capacity: enough replies decoding when a long prompt starts
LONG_PROMPTS_SHARE = 0.4  # the long-prompt phase: within one replica, a long prompt every few seconds
MIN_WARMUP_ITERATIONS = 20  # a window with fewer iterations says too little about their time
TARGET_BUDGET_SHARE = 0.25  # the TPOT SLO lets a budget of about this share of the ceiling through
CHAT_OBJECTIVE, BATCH_OBJECTIVE = "chat", "batch"
BATCH_PHASE, AFTER_BATCH_PHASE = "batch beside chat", "after the batch"
# The batch flood, as a multiple of what maxReplicas replicas prefill (3x one replica's capacity with the CPU
# example's 2): more than the service can serve beside the chat at its largest, so the router sheds some at arrival.
BATCH_FLOOD = 1.5
BATCH_TTFT_SHARE = 1 / 3  # of the service's TTFT SLO: the batch objective's target (demo_objectives says why)


@dataclass(frozen=True)
class DemoPlan:
    tpot_slo_ms: float
    ttft_slo_ms: float
    queue_wait_slo_ms: float
    prefill_tokens_per_s: float  # one replica, at the budget the TPOT SLO allows
    allowed_budget: int
    long_prompt_tokens: int
    chat: LoadPhase
    phases: list[LoadPhase]

    def describe(self, source: str = "the start-up profile") -> str:
        return (f"demo sized from {source}: SLOs p99 TPOT {self.tpot_slo_ms:.0f} ms, queue wait "
                f"{self.queue_wait_slo_ms:.0f} ms, TTFT {self.ttft_slo_ms:.0f} ms; budget the TPOT SLO allows "
                f"~{self.allowed_budget} tokens, one replica prefills ~{self.prefill_tokens_per_s:.0f} tokens/s")


def plan_demo(profile: Profile, ceiling_budget: int, max_model_len: int, scale: float = 1.0) -> DemoPlan:
    # TPOT: what an iteration of a quarter-ceiling budget costs, with room (the tuner aims at 75-80% of the
    # SLO), and never under twice the decode-only step at the expected concurrency (decodes must fit).
    target_budget = max(MIN_TOKEN_BUDGET, int(ceiling_budget * TARGET_BUDGET_SHARE))
    decode_ms = profile.decode_ms_at(CHAT_STREAMS + 2)
    tpot_slo = max(profile.iteration_ms_at(target_budget) / SLO_MARGIN, 2.0 * decode_ms)
    allowed = budget_for_tpot(profile, tpot_slo, hi=ceiling_budget)
    # Beside the chat streams' decodes, as feasibility and the scaler count it.
    prefill_rate = prefill_tokens_per_s(profile, allowed, CHAT_STREAMS) or 1.0
    # Long prompts that the ceiling budget takes in a few stalling iterations.
    long_prompt = max(ceiling_budget, min(4 * ceiling_budget, max_model_len - 64) - LONG_OUTPUT_TOKENS)
    long_rate = prefill_rate / long_prompt  # long prompts per second one replica can prefill
    # Queue wait: a few long prompts ahead (Poisson arrivals queue up now and then); TTFT: that plus one's own
    # prefill, with margin for chat.
    queue_slo = 4.0 * long_prompt / prefill_rate * 1000.0
    ttft_slo = queue_slo + 2.0 * long_prompt / prefill_rate * 1000.0
    # Chat: at most CHAT_STREAMS concurrent streams and CHAT_SHARE of the prefill capacity.
    chat_life_s = CHAT_OUTPUT_TOKENS * decode_ms / 1000.0
    chat_rate = min(CHAT_STREAMS / chat_life_s, CHAT_SHARE * prefill_rate / CHAT_PROMPT_TOKENS)
    phases = [
        LoadPhase("chat only", 30 * scale, 0.0, long_prompt, LONG_OUTPUT_TOKENS),
        # The next phase's rate is only a default: `up --demo` sizes it from the capacity the loop measured
        # for one replica under this run's conditions (beyond_one_replica).
        LoadPhase("long prompts", 60 * scale, LONG_PROMPTS_SHARE * long_rate, long_prompt, LONG_OUTPUT_TOKENS),
        LoadPhase("beyond one replica", 120 * scale, 0.9 * long_rate, long_prompt, LONG_OUTPUT_TOKENS),
        # Long enough for two replicas to drain the overload's backlog and the windows to show it.
        LoadPhase("cool-down", 60 * scale, 0.0, long_prompt, LONG_OUTPUT_TOKENS),
        # Long prompts of the sheddable objective beside the chat: the router serves what fits after the chat
        # and refuses the rest at arrival (only behind the router: without one nothing would shed them).
        # Its rate here is one replica's share: batch_phase multiplies it by maxReplicas.
        LoadPhase(BATCH_PHASE, 45 * scale, BATCH_FLOOD * long_rate, long_prompt, LONG_OUTPUT_TOKENS,
                  objective=BATCH_OBJECTIVE),
        # Chat only again: what the flood left queued drains, and the windows show whether it did. Not shorter
        # than 30 s: that drain and the stats window's clear-out take as long at any --phase-scale.
        LoadPhase(AFTER_BATCH_PHASE, 60 * max(scale, 0.5), 0.0, long_prompt, LONG_OUTPUT_TOKENS),
    ]
    chat = LoadPhase("chat", sum(p.duration_s for p in phases), chat_rate, CHAT_PROMPT_TOKENS, CHAT_OUTPUT_TOKENS)
    return DemoPlan(tpot_slo, ttft_slo, queue_slo, prefill_rate, allowed, long_prompt, chat, phases)


def p99_tpot_beside_prefill(profile: Profile, budget: int, prompt_tokens: int,
                            output_tokens: int = CHAT_OUTPUT_TOKENS, decodes: int = CHAT_STREAMS + 2) -> float:
    """The TPOT of a reply that was decoding when a long prompt's prefill began (what the p99 of a window with
    long prompts shows): as many of its gaps as the prefill has chunks at `budget` take that budget's
    iteration, the rest the decode-only step."""
    gaps = max(1, output_tokens - 1)
    room = max(1.0, prefill_room(budget, decodes))
    stalled = min(gaps, -(-prompt_tokens // room))
    return (stalled * profile.iteration_ms_at(budget) + (gaps - stalled) * profile.decode_ms_at(decodes)) / gaps


# Demand beyond one replica, as a multiple of one replica's measured prefill capacity: it needs a second
# replica, and two replicas serve it even when each prefills a fifth less beside the other (shared cores).
BEYOND_ONE_REPLICA = 1.3


# The long-prompt phase, as a share of the same figure: within one replica, so the second replica is asked
# for in "beyond one replica" and not before.
WITHIN_ONE_REPLICA = 0.6
PHASE_SHARES = {"long prompts": WITHIN_ONE_REPLICA, "beyond one replica": BEYOND_ONE_REPLICA}


def sized_phase(plan: DemoPlan, label: str, capacity_tokens_per_s: float | None) -> LoadPhase:
    """A long-prompt phase sized from one replica's prefill capacity as the control loop measured it (at the
    budget its TPOT target allows, under this run's conditions: the one figure feasibility and the scaler use
    too); the plan's own phase when none was measured. The chat load counts towards the demand."""
    phase = next(p for p in plan.phases if p.label == label)
    if not capacity_tokens_per_s or capacity_tokens_per_s <= 0:
        return phase
    chat_tokens = plan.chat.rate_per_s * plan.chat.prompt_tokens
    long_tokens = max(0.0, PHASE_SHARES[label] * capacity_tokens_per_s - chat_tokens)
    return replace(phase, rate_per_s=long_tokens / phase.prompt_tokens)


def beyond_one_replica(plan: DemoPlan, capacity_tokens_per_s: float | None) -> LoadPhase:
    return sized_phase(plan, "beyond one replica", capacity_tokens_per_s)


def batch_phase(plan: DemoPlan, capacity_tokens_per_s: float | None, max_replicas: int) -> LoadPhase:
    """The batch flood: BATCH_FLOOD times maxReplicas replicas' prefill capacity, one replica's as the loop
    measured it (the plan's profile-sized figure without one)."""
    phase = next(p for p in plan.phases if p.label == BATCH_PHASE)
    if not capacity_tokens_per_s or capacity_tokens_per_s <= 0:
        return replace(phase, rate_per_s=phase.rate_per_s * max_replicas)
    return replace(phase, rate_per_s=BATCH_FLOOD * max_replicas * capacity_tokens_per_s / phase.prompt_tokens)


def demo_objectives(plan: DemoPlan) -> Objectives:
    """chat (the default: the chat, the long prompts) at the plan's SLOs, and batch, sheddable, admitted only when
    predicted to start within BATCH_TTFT_SHARE of the service's TTFT SLO. The control loop's windows do not tell
    objectives apart (a batch request's wait in the router counts in them like a chat one's), and the router's
    prediction at arrival runs short of the wait a batch request then has behind the chat band and the flood
    (bench router --objectives measures it): the margin keeps the batch the router admits within the service's SLOs."""
    chat = Objective(CHAT_OBJECTIVE, 10, plan.ttft_slo_ms, plan.tpot_slo_ms, plan.queue_wait_slo_ms)
    batch = Objective(BATCH_OBJECTIVE, -1, BATCH_TTFT_SHARE * plan.ttft_slo_ms, plan.tpot_slo_ms,
                      plan.queue_wait_slo_ms)
    return Objectives({chat.name: chat, batch.name: batch}, chat)


@dataclass(frozen=True)
class Calibration:
    factor: float  # observed iteration time over the profile's prediction (median over the windows)
    windows: int  # how many windows it came from (0: none could tell; factor 1)
    spread: tuple[float, float] = (1.0, 1.0)  # the smallest and largest window's factor
    long_prompt_factor: float | None = None  # a long prompt's prefill alone over the profile's prediction

    @property
    def prefill_factor(self) -> float:
        """For the mixed curve: chunks of long prompts (long contexts) run at least as slow as chat did."""
        return max(self.factor, self.long_prompt_factor or 0.0)

    def describe(self) -> str:
        probe = ("" if self.long_prompt_factor is None else
                 f"; a long prompt prefilled alone took x{self.long_prompt_factor:.2f} the profile's time")
        if not self.windows:
            return "no warm-up window had enough iterations to calibrate: the start-up profile stands" + probe
        return (f"calibrated from {self.windows} warm-up window(s): iterations take x{self.factor:.2f} the start-up "
                f"profile's time here (windows x{self.spread[0]:.2f}-x{self.spread[1]:.2f})" + probe)


def predicted_prefill_ms(profile: Profile, prompt_tokens: int, budget: int) -> float:
    """A prompt prefilled alone at `budget`: one iteration per chunk, each as long as the profile says."""
    full, rest = divmod(max(0, prompt_tokens), max(1, budget))
    return full * profile.iteration_ms_at(budget) + (profile.iteration_ms_at(rest) if rest else 0.0)


def predicted_iteration_ms(profile: Profile, decodes: float, prefill_tokens: float) -> float:
    """A mean iteration of `decodes` decodes and `prefill_tokens` prefill tokens: the decode-only step plus the
    mixed curve's cost per prefill token (its slope over the first two points)."""
    points = sorted(profile.mixed, key=lambda p: p.tokens)
    slope = 0.0
    if len(points) > 1:
        slope = (points[1].iteration_ms - points[0].iteration_ms) / max(1, points[1].tokens - points[0].tokens)
    elif points:
        slope = points[0].iteration_ms / max(1, points[0].tokens)
    return profile.decode_ms_at(max(1, round(decodes))) + slope * prefill_tokens


def calibrate(windows: Sequence[WindowStats], profile: Profile,
              long_prompt_factor: float | None = None) -> Calibration:
    """How much slower than the profile this replica's iterations ran over the warm-up windows (and, given, a
    long prompt's prefill alone). A chat warm-up uses a sliver of its budget, which the control loop's estimator
    (profile_rules.observed_over_predicted) declines to judge; so each window here is set against what its
    iterations carried (predicted_iteration_ms), and the demo takes the median."""
    factors = []
    for w in windows:
        if w.iterations < MIN_WARMUP_ITERATIONS or not w.mean_iteration_ms or w.tuning.token_budget <= 0:
            continue
        tokens = w.budget_utilisation * w.tuning.token_budget  # mean tokens per busy iteration
        total = w.decode_tokens_per_s + w.prefill_tokens_per_s
        if tokens <= 0 or total <= 0:
            continue
        share = w.decode_tokens_per_s / total
        predicted = predicted_iteration_ms(profile, share * tokens, (1 - share) * tokens)
        if predicted > 0:
            factors.append(w.mean_iteration_ms / predicted)
    if not factors:
        return Calibration(1.0, 0, long_prompt_factor=long_prompt_factor)
    return Calibration(statistics.median(factors), len(factors), (min(factors), max(factors)), long_prompt_factor)
