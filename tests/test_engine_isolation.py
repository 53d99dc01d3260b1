"""One request's fault is its own: a failure preparing, sampling or detokenizing one request of a batch fails
that request alone (finish_reason "error", its KV freed) and the others finish exactly as without it."""
from __future__ import annotations

import pytest

from stallfree.node_daemon.engine.request import RequestStatus
from stallfree.node_daemon.engine.sampling_params import SamplingParams
from stallfree.node_daemon.server.metrics import EngineMetrics

from test_engine import make_engine, run_all, tokens_of

PROMPTS = {"a": "The quick brown fox", "b": "Chunked prefill keeps decodes moving", "c": "x y z",
           "d": "Paged KV cache blocks"}


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _sampling(seed: int | None = None) -> SamplingParams:
    return SamplingParams(max_tokens=12, temperature=0.8, seed=seed if seed is not None else 7, ignore_eos=True)


def _add_all(engine, seeds: dict[str, int] | None = None) -> None:
    for i, (rid, prompt) in enumerate(PROMPTS.items()):
        engine.add_request(rid, prompt, sampling=_sampling((seeds or {}).get(rid, 100 + i)))


@pytest.fixture(scope="module")
def reference() -> dict[str, list[int]]:
    engine = make_engine()
    _add_all(engine)
    return {rid: tokens_of(outs) for rid, outs in run_all(engine).items()}


def _assert_isolated(engine, outputs, failed: str, reference, same_tokens=tuple(PROMPTS)) -> None:
    last = outputs[failed][-1]
    assert last.finished and last.finish_reason == "error" and last.error
    for rid in PROMPTS:
        if rid != failed:
            assert outputs[rid][-1].finish_reason == "length"
            assert len(tokens_of(outputs[rid])) == len(reference[rid])
            if rid in same_tokens:  # seeded: the same tokens as without the fault
                assert tokens_of(outputs[rid]) == reference[rid], rid
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks
    assert not engine.has_unfinished()


def test_a_seed_beyond_64_bits_is_refused_at_admission() -> None:
    engine = make_engine()
    with pytest.raises(ValueError, match="seed"):
        engine.add_request("big", "hi", sampling=_sampling(1 << 64))
    assert not engine.has_unfinished()


def test_a_sampling_failure_fails_that_request_alone(reference) -> None:
    """The issue's repro: a seed torch.Generator cannot take, raised inside the batch's sampling step.

    "a" drew its random numbers in the failed batch before "b" raised, so its retry draws again: it still
    finishes, with other tokens; the requests after "b" keep exactly theirs."""
    engine = make_engine()
    _add_all(engine)
    object.__setattr__(engine.scheduler.get_request("b").sampling, "seed", 1 << 64)  # past admission's check, as before the fix
    outputs = run_all(engine)
    assert "Overflow" in outputs["b"][-1].error
    _assert_isolated(engine, outputs, "b", reference, same_tokens=("c", "d"))


class FailFor:
    """The real executor, except that a batch holding `request_id` raises once it decodes (an injected fault)."""

    def __init__(self, executor, request_id: str, after_tokens: int) -> None:
        self.executor, self.request_id, self.after_tokens = executor, request_id, after_tokens
        self.raised = 0

    def execute(self, output):
        for chunk in output.chunks:
            request = chunk.request
            if request.request_id == self.request_id and len(request.output_token_ids) >= self.after_tokens:
                self.raised += 1
                raise RuntimeError(f"injected fault preparing {self.request_id}")
        return self.executor.execute(output)

    def __getattr__(self, name):
        return getattr(self.executor, name)


def test_a_failure_preparing_one_request_mid_decode_fails_it_alone(reference) -> None:
    engine = make_engine()
    engine.executor = FailFor(engine.executor, "c", after_tokens=3)
    _add_all(engine)
    outputs = run_all(engine)
    assert engine.executor.raised == 2  # the batch once, then "c" alone; never again
    assert "injected fault" in outputs["c"][-1].error
    assert tokens_of(outputs["c"]) == reference["c"][:3]  # what it had streamed stays streamed
    _assert_isolated(engine, outputs, "c", reference)


def test_a_detokenizing_failure_fails_that_request_alone(reference) -> None:
    engine = make_engine()
    _add_all(engine)
    engine.step()  # prefill: every request has its first token

    class Broken:
        stopped_by = None

        def add_tokens(self, tokens):
            raise UnicodeError("injected detokenizer fault")

    engine._detokenizers["d"] = Broken()
    outputs = run_all(engine)
    assert "injected detokenizer fault" in outputs["d"][-1].error
    _assert_isolated(engine, outputs, "d", reference | {"a": reference["a"][1:], "b": reference["b"][1:],
                                                        "c": reference["c"][1:]})


def test_a_failed_request_is_not_counted_as_a_success() -> None:
    metrics = EngineMetrics("tiny")
    engine = make_engine(observer=metrics)
    engine.executor = FailFor(engine.executor, "a", after_tokens=1)
    _add_all(engine)
    run_all(engine)
    success = {reason: metrics.registry.get_sample_value("stallfree_request_success_total",
                                                         {"model_name": "tiny", "finished_reason": reason})
               for reason in ("stop", "length", "abort")}
    assert success == {"stop": 0, "length": 3, "abort": 0}
    assert metrics.registry.get_sample_value("stallfree_request_generation_tokens_count",
                                             {"model_name": "tiny"}) == 3


def test_fail_all_marks_requests_failed_not_aborted() -> None:
    engine = make_engine()
    _add_all(engine)
    engine.step()
    requests = [engine.scheduler.get_request(rid) for rid in PROMPTS]
    outputs = engine.fail_all("engine step failed: boom")
    assert {o.finish_reason for o in outputs} == {"error"} and len(outputs) == len(PROMPTS)
    assert all(r.status is RequestStatus.FINISHED_ERROR for r in requests)
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks
