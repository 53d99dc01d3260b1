"""The daemon's start-up is explicit phases (server/startup.py) and its configuration a checked, frozen object."""
from __future__ import annotations

import dataclasses

import pytest

from stallfree.cli.serve import parse_options
from stallfree.node_daemon.engine.request_rules import RequestLimits
from stallfree.node_daemon.server.startup import LiveCounts, Phase, Serving, StartUp


def _serving() -> Serving:
    return Serving(engine=object(), limits=RequestLimits(2048, 100, 256, 16), max_chars_per_token=8,
                   live_counts=lambda: LiveCounts(0, 0, 0.0), engine_error=lambda: None)


def test_phases_move_only_forward_and_serving_comes_with_ready() -> None:
    startup = StartUp()
    assert startup.phase is Phase.STARTING and startup.serving is None
    assert startup.not_serving_reason() == "starting"
    startup.advance(Phase.LOADING)
    assert startup.not_serving_reason() == "loading model"
    startup.advance(Phase.PROFILING)
    with pytest.raises(RuntimeError, match="from profiling to loading model"):
        startup.advance(Phase.LOADING)
    with pytest.raises(ValueError):
        startup.advance(Phase.READY)  # ready only with what the server needs
    serving = _serving()
    startup.ready(serving)
    assert startup.phase is Phase.READY and startup.serving is serving and startup.not_serving_reason() is None
    with pytest.raises(RuntimeError):
        startup.failed("too late")


def test_a_failed_start_up_says_why() -> None:
    startup = StartUp()
    startup.advance(Phase.LOADING)
    startup.failed("FileNotFoundError: no-such-model")
    assert startup.serving is None and startup.phase is Phase.FAILED
    assert startup.not_serving_reason() == "start-up failed: FileNotFoundError: no-such-model"
    with pytest.raises(RuntimeError):
        startup.ready(_serving())


def test_the_daemon_answers_503_until_ready_with_the_phase() -> None:
    from fastapi.testclient import TestClient

    from stallfree.node_daemon.daemon import build_daemon

    daemon, app = build_daemon(parse_options(["--backend", "sim", "--log-level", "warning"]))
    client = TestClient(app)
    ready = client.get("/ready")
    assert ready.status_code == 503 and ready.json()["reason"] == "starting"
    daemon.startup.advance(Phase.LOADING)
    body = {"model": daemon.served_model_name, "prompt": "hi", "max_tokens": 2}
    refused = client.post("/v1/completions", json=body)
    assert refused.status_code == 503 and "loading model" in refused.json()["error"]["message"]
    assert client.get("/health").status_code == 200  # starting is alive
    daemon.startup.ready(_serving())
    assert client.get("/ready").json() == {"ready": True}
    assert daemon.vocab_size == 100 and daemon.kv_capacity_tokens == 4096


def test_the_configuration_is_typed_frozen_and_checked_when_built() -> None:
    config = parse_options(["--backend", "sim", "--max-num-seqs", "500", "--max-num-seqs-ceiling", "128"])
    assert config.tuning.max_num_seqs == 128 and config.auto_budget and config.token_budget == 512
    assert not hasattr(config, "args")  # no argparse namespace behind it
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.port = 1  # type: ignore[misc]
    # Built any other way, it is checked the same: the error names the flag.
    with pytest.raises(ValueError, match="--kv-memory-fraction"):
        dataclasses.replace(config, kv_memory_fraction=1.5)
    with pytest.raises(ValueError, match="prefill room"):
        dataclasses.replace(config, token_budget=10, auto_budget=False)


def test_what_the_load_left_unreachable_is_collected_in_the_first_quiet_spell(monkeypatch) -> None:
    """Start-up freezes the load's objects without a full collection (one walked 230k objects, 116 ms of Gemma 3's
    start, and found nothing); a cycle the load left behind in the oldest generation is collected once the engine
    has been quiet, not kept for the process's life."""
    import gc
    import time
    import weakref

    from stallfree.node_daemon import daemon as daemon_module
    from stallfree.node_daemon.engine import async_engine
    from server_helpers import running_daemon

    class Leftover:
        pass

    refs = []
    real = daemon_module.build_llm_engine

    def load_leaving_a_cycle(opts, observer):
        held = Leftover()
        held.me = held
        refs.append(weakref.ref(held))
        gc.collect()  # survives into the oldest generation, as a long load's objects do
        del held  # unreachable now, and only a full collection finds it
        return real(opts, observer)

    monkeypatch.setattr(daemon_module, "build_llm_engine", load_leaving_a_cycle)
    monkeypatch.setattr(async_engine, "IDLE_TASK_QUIET_S", 600.0)  # no quiet spell yet, however slow the machine
    with running_daemon(["--backend", "sim", "--no-profile"]) as live:
        deadline = time.monotonic() + 30
        while not live.daemon.startup.serving and time.monotonic() < deadline:
            time.sleep(0.05)
        assert live.daemon.startup.serving
        assert refs[0]() is not None  # frozen at start-up, not collected on the way to ready
        monkeypatch.setattr(async_engine, "IDLE_TASK_QUIET_S", 0.2)
        live.daemon.engine.when_quiet(lambda: None)  # wakes the engine loop, which sees the shorter spell
        deadline = time.monotonic() + 30
        while refs[0]() is not None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert refs[0]() is None


def test_the_grammar_vocabulary_is_built_after_ready_in_the_first_quiet_spell(monkeypatch) -> None:
    """The structured-output library's view of the vocabulary holds the GIL while it builds (0.14-0.2 s for a 49k
    vocabulary): never on the way to ready, once the engine is first quiet."""
    import time

    from stallfree.node_daemon.engine import async_engine
    from server_helpers import running_daemon

    monkeypatch.setattr(async_engine, "IDLE_TASK_QUIET_S", 600.0)  # no quiet spell yet, however slow the machine
    with running_daemon(["--no-profile"]) as live:
        deadline = time.monotonic() + 60
        while not live.daemon.startup.serving and time.monotonic() < deadline:
            time.sleep(0.05)
        compiler = live.daemon.startup.serving.structured.compiler
        assert compiler is not None and not compiler.has_vocabulary  # ready without it
        monkeypatch.setattr(async_engine, "IDLE_TASK_QUIET_S", 0.2)
        live.daemon.engine.when_quiet(lambda: None)  # wakes the engine loop, which sees the shorter spell
        deadline = time.monotonic() + 30
        while not compiler.has_vocabulary and time.monotonic() < deadline:
            time.sleep(0.05)
        assert compiler.has_vocabulary
