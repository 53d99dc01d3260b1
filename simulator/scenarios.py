"""The textbook stall: N users decoding, then one long prompt arrives.

Without chunking the long prompt's prefill runs as one iteration and every running decode waits for
all of it; with a token budget the prompt is cut into chunks that ride along with the decodes. The
scenario reports the largest decode gap while that prompt prefills, the prompt's TTFT, and how many
tokens the running users got meanwhile.
"""
from __future__ import annotations

from dataclasses import asdict, replace
from typing import Any

from stallfree.simulator.simulate import SimSetup

LONG_PROMPT_ID = "long-prompt"


class _TokenTimes:
    """EngineObserver keeping every token time per request (the scenario is small)."""

    def __init__(self) -> None:
        self.times: dict[str, list[float]] = {}
        self.iterations: list[tuple[float, float]] = []  # (start, end)

    def on_token(self, request, now: float, first: bool) -> None:
        self.times.setdefault(request.request_id, []).append(now)

    def on_iteration(self, record) -> None:
        self.iterations.append((record.start, record.start + record.duration_s))

    def on_finished(self, request, now: float) -> None:
        pass


def long_prompt_scenario(setup: SimSetup, decoders: int, prompt_len: int, decoder_prompt_len: int = 1024,
                         decoder_output_len: int = 2048, no_chunking: bool = False,
                         limit_s: float = 3600.0) -> dict[str, Any]:
    """Run the scenario; `no_chunking` switches the policy to prefill-priority (whole prompts).

    Decoders must still be decoding when the prompt's prefill ends: give them a long enough output.
    """
    if decoders < 0 or prompt_len < 1 or decoder_prompt_len < 1 or decoder_output_len < 1:
        raise ValueError("decoders must be >= 0 and prompt and output lengths >= 1")
    if prompt_len + 1 > setup.max_model_len or decoder_prompt_len + decoder_output_len > setup.max_model_len:
        raise ValueError(f"the prompt ({prompt_len}) or a decoder ({decoder_prompt_len} + {decoder_output_len}) "
                         f"does not fit max_model_len {setup.max_model_len}")
    # Room for every decoder plus the long prompt; decoders keep decoding past the prefill.
    setup = replace(setup, policy="prefill-priority" if no_chunking else setup.policy,
                    max_num_seqs=max(setup.max_num_seqs, decoders + 1))
    tokens = _TokenTimes()
    replica = setup.build_replica(observer=tokens)
    kv_tokens = replica.kv_cache.num_blocks * replica.kv_cache.block_size
    need = decoders * (decoder_prompt_len + decoder_output_len) + prompt_len + 1
    if need > kv_tokens:
        raise ValueError(f"the scenario needs {need} tokens of KV cache, the replica holds {kv_tokens}: "
                         f"use fewer decoders or shorter decoder outputs")
    for i in range(decoders):
        replica.submit(decoder_prompt_len, decoder_output_len, arrival_time=0.0, request_id=f"decoder-{i}")
    # Warm up until every decoder has produced a token: they are all in steady decode.
    while len(tokens.times) < decoders:
        _advance(replica, limit_s)
    t_steady = replica.now
    replica.advance_to(replica.now + 0.05)
    t0 = replica.now
    replica.submit(prompt_len, 1, arrival_time=t0, request_id=LONG_PROMPT_ID)
    while LONG_PROMPT_ID not in tokens.times:
        _advance(replica, limit_s)
    t_first = tokens.times[LONG_PROMPT_ID][0]
    # Until every decoder got its next token: the gap that spans the prefill ends there.
    while any(times[-1] < t_first for rid, times in tokens.times.items() if rid != LONG_PROMPT_ID):
        if replica.num_finished > 1:  # the long prompt itself finishes at its first token
            raise ValueError("a decoder finished before the long prompt's prefill ended: raise decoder_output_len")
        _advance(replica, limit_s)
    ttft_s = t_first - t0

    max_gap_s, during = 0.0, 0
    steady_gaps: list[float] = []
    for request_id, times in tokens.times.items():
        if request_id == LONG_PROMPT_ID:
            continue
        for prev, cur in zip(times, times[1:]):
            if cur > t0 and prev < t_first:  # the gap overlaps the prefill
                max_gap_s = max(max_gap_s, cur - prev)
            elif cur <= t0 and prev >= t_steady:
                steady_gaps.append(cur - prev)
        during += sum(1 for t in times if t0 < t <= t_first)
    return {
        "policy": setup.policy,
        "token_budget": None if no_chunking else setup.tuning().token_budget,
        "no_chunking": no_chunking,
        "decoders": decoders,
        "decoder_prompt_len": decoder_prompt_len,
        "prompt_len": prompt_len,
        "model": setup.model,
        "hardware": asdict(replica.cost_model.hardware),
        "max_decode_gap_ms": max_gap_s * 1000,
        "ttft_ms": ttft_s * 1000,
        "decode_tokens_during_prefill": during,
        "prefill_iterations": sum(1 for start, end in tokens.iterations if start >= t0 and end <= t_first),
        "steady_decode_gap_ms": max(steady_gaps) * 1000 if steady_gaps else None,
    }


def _advance(replica, limit_s: float) -> None:
    if replica.now > limit_s:
        raise RuntimeError(f"the scenario did not reach its end within {limit_s} s of virtual time")
    replica.advance_to(replica.now + 0.01)
