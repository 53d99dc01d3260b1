"""An observer (metrics, stats window) that raises: requests are served regardless, the fault counted and logged
once per kind."""
from __future__ import annotations

import logging

from stallfree.node_daemon.engine.sampling_params import SamplingParams
from tests.test_engine import make_engine, one_torch_thread, run_all, tokens_of  # noqa: F401 (autouse)


class Faulty:
    def __init__(self) -> None:
        self.calls = 0

    def on_iteration(self, record) -> None:
        self.calls += 1
        raise RuntimeError("gauge broke")

    def on_token(self, request, now, first) -> None:
        raise ZeroDivisionError("tpot of one token")

    def on_finished(self, request, now) -> None:
        pass


def test_a_raising_observer_fails_no_request_and_is_counted_and_logged_once(caplog) -> None:
    sampling = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    reference = make_engine()
    reference.add_request("a", prompt_token_ids=list(range(10, 40)), sampling=sampling)
    expected = tokens_of(run_all(reference)["a"])

    faulty = Faulty()
    engine = make_engine(observer=faulty)
    counted: list[str] = []
    engine.on_observer_error = counted.append
    engine.add_request("a", prompt_token_ids=list(range(10, 40)), sampling=sampling)
    with caplog.at_level(logging.ERROR, logger="stallfree.node_daemon.engine.engine"):
        outs = run_all(engine)["a"]
    assert outs[-1].finish_reason == "length" and tokens_of(outs) == expected
    assert engine.observer_errors == {"on_iteration": faulty.calls, "on_token": 8}
    assert counted.count("on_token") == 8 and counted.count("on_iteration") == faulty.calls
    logged = [r for r in caplog.records if "observer" in r.getMessage()]
    assert len(logged) == 2 and all(r.exc_info for r in logged)  # one per kind, not one per step or token
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks
