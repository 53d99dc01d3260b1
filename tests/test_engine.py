"""LLMEngine on the tiny random-weight model, end to end: scheduler, model runner, sampler, detokenizer."""
from __future__ import annotations

import dataclasses

import pytest

from stallfree.contracts import Ceilings, Tuning, TuningError
from stallfree.node_daemon.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from stallfree.node_daemon.models.config import ModelConfig
from stallfree.node_daemon.engine.engine import LLMEngine
from stallfree.node_daemon.engine.engine_protocol import IterationRecord, RequestOutput
from stallfree.node_daemon.engine.output_length import OutputLengthEstimate
from stallfree.node_daemon.engine.request import Request
from stallfree.node_daemon.engine.sampling_params import SamplingParams

MAX_MODEL_LEN = 256
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
PROMPTS = ["The quick brown fox", "Chunked prefill keeps decodes moving " * 3, "x", "Paged KV cache blocks"]


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """One intra-op thread: on a shared CPU, spinning OpenMP workers make the tiny model many times slower."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def make_engine(num_blocks: int = 96, budget: int = 512, max_num_seqs: int = 16, observer=None,
                tokenizer=None, prefix_caching: bool = True) -> LLMEngine:
    config = EngineConfig(
        model=ModelConfig(model="tiny", max_model_len=MAX_MODEL_LEN),
        cache=CacheConfig(block_size=16, num_blocks=num_blocks, enable_prefix_caching=prefix_caching),
        scheduler=SchedulerConfig(ceilings=Ceilings(max_token_budget=512, max_num_seqs=16),
                                  tuning=Tuning(token_budget=budget, max_num_seqs=max_num_seqs)),
    )
    return LLMEngine(config, tokenizer=tokenizer, observer=observer)


def run_all(engine: LLMEngine, max_steps: int = 2000) -> dict[str, list[RequestOutput]]:
    outputs: dict[str, list[RequestOutput]] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished():
            return outputs
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    raise AssertionError("the engine did not finish")


def tokens_of(outs: list[RequestOutput]) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


def text_of(outs: list[RequestOutput]) -> str:
    return "".join(o.text for o in outs)


@pytest.fixture(scope="module")
def reference() -> dict[str, list[RequestOutput]]:
    """Each prompt alone, greedy, with a large budget: the tokens every other schedule must reproduce."""
    engine = make_engine()
    result = {}
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt=prompt, sampling=GREEDY)
        result.update(run_all(engine))
    return result


def test_greedy_is_deterministic_and_batch_invariant_across_budgets(reference) -> None:
    for budget in (512, 48):  # 48: prompts are chunked, and chunks split blocks unevenly
        engine = make_engine(budget=budget)
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(f"r{i}", prompt=prompt, sampling=GREEDY)
        got = run_all(engine)
        for rid, outs in reference.items():
            assert tokens_of(got[rid]) == tokens_of(outs), (budget, rid)
            assert got[rid][-1].finish_reason == "length" and got[rid][-1].num_output_tokens == GREEDY.max_tokens
        assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks


def test_streamed_text_matches_the_decoded_tokens(reference) -> None:
    engine = make_engine()
    for rid, outs in reference.items():
        assert text_of(outs) == engine.tokenizer.decode(tokens_of(outs))
        assert all(len(o.new_token_ids) == 1 for o in outs)


def test_seeded_sampling_reproduces_in_any_company() -> None:
    seeded = SamplingParams(max_tokens=20, temperature=1.0, top_p=0.95, seed=7, ignore_eos=True)
    alone = make_engine()
    alone.add_request("s", prompt="seeded", sampling=seeded)
    first = tokens_of(run_all(alone)["s"])
    crowded = make_engine(budget=48)
    crowded.add_request("noise", prompt="other text", sampling=SamplingParams(max_tokens=30, temperature=1.0))
    crowded.add_request("s", prompt="seeded", sampling=seeded)
    crowded.add_request("s2", prompt="seeded", sampling=dataclasses.replace(seeded, seed=8))
    got = run_all(crowded)
    assert tokens_of(got["s"]) == first
    assert tokens_of(got["s2"]) != first


def test_stop_string_ends_the_request_and_is_not_emitted(reference) -> None:
    full = text_of(reference["r0"])
    at = next(i for i in range(3, len(full) - 2) if "\ufffd" not in full[i:i + 2] and full[i:i + 2] not in full[:i])
    stop = full[at:at + 2]
    engine = make_engine()
    engine.add_request("s", prompt=PROMPTS[0], sampling=dataclasses.replace(GREEDY, stop=[stop]))
    outs = run_all(engine)["s"]
    assert outs[-1].finished and outs[-1].finish_reason == "stop"
    assert text_of(outs) == full[:at]
    assert len(outs) < len(reference["r0"])
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks


def test_eos_stops_without_text_and_ignore_eos_runs_on(reference) -> None:
    tokens = tokens_of(reference["r1"])
    k = next(i for i in range(2, len(tokens)) if tokens[i] not in tokens[:i])
    eos = tokens[k]
    base = make_engine().tokenizer
    engine = make_engine(tokenizer=dataclasses.replace(base, eos_token_ids=(eos,)))
    engine.add_request("e", prompt=PROMPTS[1], sampling=dataclasses.replace(GREEDY, ignore_eos=False))
    engine.add_request("i", prompt=PROMPTS[1], sampling=GREEDY)
    got = run_all(engine)
    assert tokens_of(got["e"]) == tokens[:k + 1]
    assert got["e"][-1].finish_reason == "stop"
    assert text_of(got["e"]) == text_of(reference["r1"][:k])
    assert tokens_of(got["i"]) == tokens


def test_stop_token_ids_end_the_request(reference) -> None:
    tokens = tokens_of(reference["r2"])
    k = next(i for i in range(1, len(tokens)) if tokens[i] not in tokens[:i])
    engine = make_engine()
    engine.add_request("t", prompt=PROMPTS[2], sampling=dataclasses.replace(GREEDY, stop_token_ids=[tokens[k]]))
    outs = run_all(engine)["t"]
    assert tokens_of(outs) == tokens[:k + 1] and outs[-1].finish_reason == "stop"


def test_abort_frees_blocks_at_once_and_others_finish(reference) -> None:
    engine = make_engine()
    for i, prompt in enumerate(PROMPTS[:2]):
        engine.add_request(f"r{i}", prompt=prompt, sampling=GREEDY)
    engine.add_request("victim", prompt="to be aborted " * 4, sampling=GREEDY)
    outs: dict[str, list[RequestOutput]] = {}
    for _ in range(3):
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)
    held = len(engine.scheduler.get_request("victim").block_ids)
    assert held > 0
    free_before = engine.kv_cache.num_free_blocks
    aborted = engine.abort_request("victim")
    assert aborted is not None and aborted.status.value == "abort"
    assert engine.kv_cache.num_free_blocks >= free_before + 1  # its blocks are back (cached ones stay reusable)
    assert engine.abort_request("victim") is None and engine.abort_request("never-existed") is None
    for rid, more in run_all(engine).items():
        outs.setdefault(rid, []).extend(more)
    assert "victim" not in {rid for rid, o in outs.items() if o[-1].finished}
    for rid in ("r0", "r1"):
        assert tokens_of(outs[rid]) == tokens_of(reference[rid])
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks


def test_bad_input_is_rejected_and_requests_in_flight_continue(reference) -> None:
    engine = make_engine()
    engine.add_request("r0", prompt=PROMPTS[0], sampling=GREEDY)
    outs = [o for _ in range(2) for o in engine.step()]
    bad = [
        (dict(prompt=""), "empty"),
        (dict(prompt_token_ids=[]), "empty"),
        (dict(prompt="é" * MAX_MODEL_LEN), f"maximum context length is {MAX_MODEL_LEN} tokens"),
        (dict(prompt="ok", sampling=SamplingParams(max_tokens=0)), "max_tokens"),
        (dict(prompt="ok", sampling=SamplingParams(temperature=-1)), "temperature"),
        (dict(prompt_token_ids=[1, 99999]), "outside the vocabulary"),
        (dict(prompt="a", prompt_token_ids=[1]), "exactly one"),
    ]
    for kwargs, message in bad:
        with pytest.raises(ValueError, match=message):
            engine.add_request("bad", **kwargs)
    with pytest.raises(ValueError, match="already in flight"):
        engine.add_request("r0", prompt="dup", sampling=GREEDY)
    assert engine.num_unfinished == 1 and engine.scheduler.num_waiting + engine.scheduler.num_running == 1
    outs += run_all(engine)["r0"]
    assert tokens_of(outs) == tokens_of(reference["r0"])


def test_generation_is_capped_at_the_context() -> None:
    engine = make_engine()
    engine.add_request("long", prompt_token_ids=list(range(MAX_MODEL_LEN - 5)),
                       sampling=SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True))
    outs = run_all(engine)["long"]
    assert outs[-1].finish_reason == "length" and outs[-1].num_output_tokens == 5


def test_preemption_under_a_tiny_kv_cache_keeps_the_greedy_tokens(reference) -> None:
    # 10 blocks of 16 tokens; each request needs 2-5 blocks at the end, so four cannot all stay resident.
    engine = make_engine(num_blocks=10, budget=64)
    engine.scheduler.output_estimate = OutputLengthEstimate.fixed(0)  # admit on the prompt alone: KV runs out
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt=prompt, sampling=GREEDY)
    got = run_all(engine)
    assert engine.scheduler.num_preemptions > 0
    for rid, outs in reference.items():
        assert tokens_of(got[rid]) == tokens_of(outs), rid
        assert text_of(got[rid]) == text_of(outs)
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks


def test_prefix_cache_hit_is_reported_and_exact(reference) -> None:
    engine = make_engine()
    engine.add_request("a", prompt=PROMPTS[1], sampling=GREEDY)
    run_all(engine)
    engine.add_request("b", prompt=PROMPTS[1], sampling=GREEDY)
    outs = run_all(engine)["b"]
    assert outs[-1].num_cached_tokens >= 16
    assert tokens_of(outs) == tokens_of(reference["r1"])


class RecordingObserver:
    def __init__(self) -> None:
        self.iterations: list[IterationRecord] = []
        self.tokens: list[tuple[str, bool, float | None]] = []
        self.finished: list[tuple[str, str]] = []

    def on_iteration(self, record: IterationRecord) -> None:
        self.iterations.append(record)

    def on_token(self, request: Request, now: float, first: bool) -> None:
        assert request.first_scheduled_time is not None and request.first_scheduled_time <= now
        self.tokens.append((request.request_id, first, request.last_token_time))

    def on_finished(self, request: Request, now: float) -> None:
        self.finished.append((request.request_id, request.status.value))


def test_observer_sees_every_iteration_token_and_finish() -> None:
    observer = RecordingObserver()
    engine = make_engine(budget=48, observer=observer)
    engine.add_request("a", prompt=PROMPTS[1], sampling=GREEDY)
    engine.add_request("b", prompt=PROMPTS[0], sampling=SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    engine.add_request("c", prompt="aborted", sampling=GREEDY)
    engine.step()
    engine.abort_request("c")
    run_all(engine)
    assert len(observer.iterations) == engine.num_iterations
    assert all(r.num_prefill_tokens + r.num_decode_tokens <= r.token_budget == 48 for r in observer.iterations)
    prompt_tokens = sum(len(engine.tokenizer.encode(p)) for p in (PROMPTS[1], PROMPTS[0]))
    assert sum(r.num_prefill_tokens for r in observer.iterations) >= prompt_tokens
    per_request = {rid: [t for t in observer.tokens if t[0] == rid] for rid in ("a", "b")}
    assert len(per_request["a"]) == GREEDY.max_tokens and len(per_request["b"]) == 5
    for toks in per_request.values():
        assert toks[0][1] and toks[0][2] is None  # first token: no previous token time yet
        assert not any(first for _, first, _ in toks[1:]) and all(t is not None for _, _, t in toks[1:])
    assert sorted(observer.finished) == [("a", "length"), ("b", "length"), ("c", "abort")]


def test_live_tuning_is_checked_against_the_ceilings_and_used_at_the_next_step() -> None:
    observer = RecordingObserver()
    engine = make_engine(observer=observer)
    engine.add_request("a", prompt_token_ids=list(range(150)), sampling=GREEDY)
    engine.step()
    assert observer.iterations[-1].num_prefill_tokens == 150  # the whole prompt under budget 512
    engine.set_tuning(Tuning(token_budget=64, max_num_seqs=8))
    assert engine.get_tuning().token_budget == 64
    with pytest.raises(TuningError, match="ceiling"):
        engine.set_tuning(Tuning(token_budget=4096, max_num_seqs=8))
    assert engine.get_tuning() == Tuning(token_budget=64, max_num_seqs=8)
    engine.add_request("b", prompt_token_ids=list(range(100, 250)), sampling=GREEDY)
    engine.step()
    record = observer.iterations[-1]
    assert record.token_budget == 64 and record.max_num_seqs == 8
    assert (record.num_decode_tokens, record.num_prefill_tokens) == (1, 63)  # a's decode, then b's first chunk
