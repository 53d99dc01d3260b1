"""The built-in load of `stallfree up --demo`, and its SLOs, sized from the replica's own measured profile.

Nothing here is a fixed rate or a fixed latency: every figure is a multiple of what this replica measured at
start-up, so the demo means the same on a fast machine and a slow one, quiet or busy. The story:

1. chat: short requests throughout, a small share of the replica's prefill capacity;
2. long prompts: prompts that a ceiling-sized budget takes in few, long iterations. The daemons start at the
   ceiling budget, so every chat stream stalls behind them and p99 TPOT breaches; the tuner must find the way
   down from feedback;
3. beyond one replica: long-prompt demand above what one replica can prefill at the budget the TPOT SLO
   allows; no budget can serve it, queue wait breaches, and the scaler adds a replica;
4. cool-down: chat only, every SLO back under.
"""
from __future__ import annotations

from dataclasses import dataclass

from stallfree.contracts import Profile
from stallfree.operator.local.load import LoadPhase

CHAT_PROMPT_TOKENS = 64
CHAT_OUTPUT_TOKENS = 32
LONG_OUTPUT_TOKENS = 16
CHAT_STREAMS = 4  # chat requests decoding at once on one replica, by Little's law
TARGET_BUDGET_SHARE = 0.25  # the TPOT SLO lets a budget of about this share of the ceiling through


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

    def describe(self) -> str:
        return (f"demo sized from the profile: SLOs p99 TPOT {self.tpot_slo_ms:.0f} ms, queue wait "
                f"{self.queue_wait_slo_ms:.0f} ms, TTFT {self.ttft_slo_ms:.0f} ms; budget the TPOT SLO allows "
                f"~{self.allowed_budget} tokens, one replica prefills ~{self.prefill_tokens_per_s:.0f} tokens/s")


def decode_ms_at(profile: Profile, num_decodes: int) -> float:
    """A decode-only iteration at this concurrency, interpolated over the profile's decode-only points."""
    points = sorted(profile.decode_only, key=lambda p: p.num_decodes)
    if not points:
        return profile.iteration_ms_at(num_decodes)
    if num_decodes <= points[0].num_decodes:
        return points[0].iteration_ms
    for lo, hi in zip(points, points[1:]):
        if num_decodes <= hi.num_decodes:
            frac = (num_decodes - lo.num_decodes) / max(1, hi.num_decodes - lo.num_decodes)
            return lo.iteration_ms + frac * (hi.iteration_ms - lo.iteration_ms)
    return points[-1].iteration_ms * num_decodes / max(1, points[-1].num_decodes)


def plan_demo(profile: Profile, ceiling_budget: int, max_model_len: int, scale: float = 1.0) -> DemoPlan:
    # TPOT: what an iteration of a quarter-ceiling budget costs, with room (the tuner aims at 75-80% of the
    # SLO), and never under twice the decode-only step at the expected concurrency (decodes must fit).
    target_budget = max(64, int(ceiling_budget * TARGET_BUDGET_SHARE))
    decode_ms = decode_ms_at(profile, CHAT_STREAMS + 2)
    tpot_slo = max(profile.iteration_ms_at(target_budget) / 0.8, 2.0 * decode_ms)
    allowed = profile.budget_for(0.8 * tpot_slo, lo=64, hi=ceiling_budget)
    prefill_rate = allowed / (profile.iteration_ms_at(allowed) / 1000.0)
    # Long prompts that the ceiling budget takes in a few stalling iterations.
    long_prompt = max(ceiling_budget, min(4 * ceiling_budget, max_model_len - 64) - LONG_OUTPUT_TOKENS)
    long_rate = prefill_rate / long_prompt  # long prompts per second one replica can prefill
    # Queue wait: a few long prompts ahead; TTFT: that plus one's own prefill, with margin for chat.
    queue_slo = 3.0 * long_prompt / prefill_rate * 1000.0
    ttft_slo = queue_slo + 2.0 * long_prompt / prefill_rate * 1000.0
    # Chat: about CHAT_STREAMS concurrent streams, but never more than 15% of the prefill capacity.
    chat_life_s = CHAT_OUTPUT_TOKENS * decode_ms / 1000.0
    chat_rate = min(CHAT_STREAMS / chat_life_s, 0.15 * prefill_rate / CHAT_PROMPT_TOKENS)
    phases = [
        LoadPhase("chat only", 30 * scale, 0.0, long_prompt, LONG_OUTPUT_TOKENS),
        # The profile is measured alone; beside chat decodes, a second replica and the load's own process on
        # the same cores a replica prefills less (about 0.5-0.6x here): the shares below leave for that.
        LoadPhase("long prompts", 90 * scale, 0.3 * long_rate, long_prompt, LONG_OUTPUT_TOKENS),
        LoadPhase("beyond one replica", 120 * scale, 0.9 * long_rate, long_prompt, LONG_OUTPUT_TOKENS),
        LoadPhase("cool-down", 60 * scale, 0.0, long_prompt, LONG_OUTPUT_TOKENS),
    ]
    chat = LoadPhase("chat", sum(p.duration_s for p in phases), chat_rate, CHAT_PROMPT_TOKENS, CHAT_OUTPUT_TOKENS)
    return DemoPlan(tpot_slo, ttft_slo, queue_slo, prefill_rate, allowed, long_prompt, chat, phases)
