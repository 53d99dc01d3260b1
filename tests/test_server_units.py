"""Pure pieces of the server: request models, backpressure bounds, drain bookkeeping, auth secrets."""
from __future__ import annotations

import asyncio

import pytest
from pydantic import ValidationError

from stallfree.node_daemon.server.auth import load_secret
from stallfree.node_daemon.server.backpressure import AdmissionControl, Refusal
from stallfree.node_daemon.server.drain import DrainState, drain
from stallfree.node_daemon.server.protocol import ChatCompletionRequest, CompletionRequest


def test_chat_request_prefers_max_completion_tokens_and_flattens_content_parts() -> None:
    req = ChatCompletionRequest.model_validate({
        "model": "m", "max_tokens": 5, "max_completion_tokens": 9, "stop": "END", "seed": 3,
        "messages": [{"role": "developer", "content": "rules"},
                     {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
        "some_future_field": True})
    assert req.requested_max_tokens() == 9
    assert req.chat_messages() == [{"role": "system", "content": "rules"}, {"role": "user", "content": "ab"}]
    params = req.to_sampling_params(9)
    assert (params.max_tokens, params.stop, params.seed, params.temperature) == (9, ["END"], 3, 1.0)
    assert req.unsupported() is None


def test_unsupported_fields_are_named() -> None:
    assert CompletionRequest(model="m", prompt="x", best_of=2).unsupported()[0] == "best_of"
    assert CompletionRequest(model="m", prompt="x", echo=True).unsupported() is None
    assert CompletionRequest(model="m", prompt="x", echo=True, logprobs=1).unsupported()[0] == "logprobs"
    assert CompletionRequest(model="m", prompt="x", n=2).unsupported() is None
    assert CompletionRequest(model="m", prompt="x", n=200).invalid(None)[0] == "n"
    assert CompletionRequest(model="m", prompt=[[1, 2], [3]]).unsupported()[0] == "prompt"
    assert CompletionRequest(model="m", prompt=[[1, 2]]).single_prompt() == [1, 2]
    assert CompletionRequest(model="m", prompt="x", stream_options={"include_usage": True}).unsupported()[0] \
        == "stream_options"
    tools = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}], tools=[{"type": "function"}])
    assert tools.unsupported() is None  # served; a malformed tool is a 400 naming tools when the request is planned
    legacy = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}],
                                   functions=[{"name": "f"}], function_call={"name": "f"})
    assert legacy.effective_tools() == [{"type": "function", "function": {"name": "f"}}]
    assert legacy.effective_tool_choice() == {"type": "function", "function": {"name": "f"}}
    with pytest.raises(ValidationError):
        ChatCompletionRequest(model="m", messages=[])
    with pytest.raises(ValidationError):
        CompletionRequest(model="m", prompt="x", max_tokens=0)


def test_admission_bounds_requests_and_tokens() -> None:
    control = AdmissionControl(max_queue_requests=3, max_queue_tokens=100, prefill_tokens_per_s=lambda: 20.0)
    huge = control.try_admit(500)  # an empty queue takes any one request
    assert not isinstance(huge, Refusal)
    refused = control.try_admit(1)
    assert isinstance(refused, Refusal) and refused.status == 429 and "prompt tokens" in refused.message
    assert refused.retry_after_s == 25  # 500 queued tokens at 20 tokens/s
    control.dequeue(huge)
    control.dequeue(huge)  # idempotent
    assert (control.queued_requests, control.queued_tokens) == (0, 0)
    tickets = [control.try_admit(10) for _ in range(3)]
    assert all(not isinstance(t, Refusal) for t in tickets)
    full = control.try_admit(10)
    assert isinstance(full, Refusal) and "requests already queued" in full.message
    assert AdmissionControl(0, 0).try_admit(10**9).queued  # 0 = unbounded
    assert AdmissionControl(1, 0).retry_after_s() == 1  # no measured rate yet
    with pytest.raises(ValueError):
        AdmissionControl(-1, 0)


def test_drain_waits_for_in_flight_then_aborts_the_rest() -> None:
    async def scenario() -> tuple[int, int, list[str]]:
        state = DrainState(grace_s=0.2)
        state.enter("quick")
        state.enter("slow")
        asyncio.get_running_loop().call_later(0.05, state.leave, "quick")
        aborted: list[str] = []

        async def abort(request_id: str) -> None:
            aborted.append(request_id)
            state.leave(request_id)

        n = await drain(state, abort)
        idle = DrainState(grace_s=5)
        return n, await drain(idle, abort), aborted

    n, idle_n, aborted = asyncio.run(scenario())
    assert n == 1 and aborted == ["slow"] and idle_n == 0


def test_secrets_come_from_files_then_env(tmp_path, monkeypatch) -> None:
    path = tmp_path / "token"
    path.write_text("  s3cret\n")
    monkeypatch.setenv("SOME_TOKEN", "from-env")
    assert load_secret(str(path), "SOME_TOKEN") == "s3cret"
    assert load_secret(None, "SOME_TOKEN") == "from-env"
    monkeypatch.setenv("SOME_TOKEN", "")
    assert load_secret(None, "SOME_TOKEN") is None
    with pytest.raises(ValueError, match="cannot read"):
        load_secret(str(tmp_path / "missing"), "SOME_TOKEN")
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        load_secret(str(tmp_path / "empty"), "SOME_TOKEN")


def test_serve_command_line_errors_are_one_line_and_exit_2(capsys) -> None:
    from stallfree.cli.serve import main, parse_options

    for argv, needle in ((["--max-num-seqs", "0"], "--max-num-seqs"), (["--token-budget", "lots"], "--token-budget"),
                         (["--token-budget", "10", "--max-num-seqs", "64"], "prefill room"),
                         (["--kv-memory-fraction", "1.5"], "--kv-memory-fraction"),
                         (["--no-profile", "--tpot-slo-ms", "20"], "profile")):
        with pytest.raises(ValueError, match=needle):
            parse_options(argv)
        assert main(argv) == 2
        assert "stallfree serve: error:" in capsys.readouterr().err
    opts = parse_options(["--max-num-seqs", "500", "--max-num-seqs-ceiling", "128", "--max-token-budget", "1024"])
    assert opts.tuning.max_num_seqs == 128 and opts.auto_budget and opts.tuning.token_budget == 512


def test_start_up_failure_exits_1(capsys) -> None:
    from server_helpers import free_port
    from stallfree.cli.serve import main

    assert main(["--model", "no-such-model", "--host", "127.0.0.1", "--port", str(free_port()),
                 "--log-level", "error"]) == 1
    assert "no-such-model" in capsys.readouterr().err


def test_serve_binds_loopback_unless_told_and_help_shows_defaults(capsys) -> None:
    from stallfree.cli.serve import build_parser, parse_options

    assert parse_options(["--backend", "sim"]).host == "127.0.0.1"
    assert parse_options(["--backend", "sim", "--host", "0.0.0.0"]).host == "0.0.0.0"
    help_text = " ".join(build_parser().format_help().split())
    for shown in ("(default: 127.0.0.1)", "(default: 8000)", "(default: 10.0)", "(default: 30.0)",
                  "(default: 4096)", "(default: smollm2-135m)"):
        assert shown in help_text, shown


def test_rendered_daemons_listen_on_every_interface() -> None:
    """Pods are reached through a Service: the rendered Deployment passes --host 0.0.0.0 itself."""
    from stallfree.operator.api.spec import parse_spec
    from stallfree.operator.reconcile.render import pod_template, startup_knobs

    spec = parse_spec({"model": {"source": "embedded", "name": "smollm2-135m"}, "slos": {"tpotP99Ms": 200}})
    args = pod_template("svc", spec, startup_knobs(spec, None))["spec"]["containers"][0]["args"]
    assert args[args.index("--host") + 1] == "0.0.0.0"


def test_long_prompts_are_counted_in_pieces_and_never_refused_when_they_fit() -> None:
    from types import SimpleNamespace

    from stallfree.node_daemon.server.errors import APIError
    from stallfree.node_daemon.server.openai_routes import PIECE_CHARS, _encode
    from stallfree.node_daemon.text.tokenizer import byte_level_tokenizer

    tokenizer = byte_level_tokenizer(512)  # one token per byte: the count is exact
    engine = SimpleNamespace(max_model_len=3 * PIECE_CHARS, encode=tokenizer.encode)
    daemon = SimpleNamespace(require_engine=lambda: engine)
    fits = "ab c" * (3 * PIECE_CHARS // 4 - 1)  # just under the context, over two pieces
    assert _encode(daemon, fits) == tokenizer.encode(fits)
    with pytest.raises(APIError) as caught:
        _encode(daemon, "x" * (4 * PIECE_CHARS))
    assert caught.value.status == 400 and caught.value.code == "context_length_exceeded"


def test_probe_port_is_off_unless_given_and_never_the_serving_port() -> None:
    from stallfree.cli.serve import parse_options

    assert parse_options(["--backend", "sim"]).probe_port == 0
    assert parse_options(["--backend", "sim", "--probe-port", "8001"]).probe_port == 8001
    for bad in ("8000", "-1", "70000"):
        with pytest.raises(ValueError, match="--probe-port"):
            parse_options(["--backend", "sim", "--port", "8000", "--probe-port", bad])


def test_the_probe_listener_reports_a_dead_engine_loop() -> None:
    from types import SimpleNamespace

    from starlette.testclient import TestClient

    from stallfree.node_daemon.server.probes import create_probe_app

    daemon = SimpleNamespace(engine=object(), engine_error=lambda: None, not_ready_reason=lambda: None)
    client = TestClient(create_probe_app(daemon))
    assert client.get("/health").json() == {"status": "ok"} and client.get("/ready").status_code == 200
    daemon.engine_error = lambda: "engine loop died"
    daemon.not_ready_reason = lambda: "engine loop died"
    health = client.get("/health")
    assert health.status_code == 500 and health.json()["reason"] == "engine loop died"
    assert client.get("/ready").status_code == 503


def test_a_start_up_failure_stops_the_probe_listener_too(capsys) -> None:
    from server_helpers import free_port
    from stallfree.cli.serve import main

    port = free_port()
    probe_port = next(p for p in iter(free_port, None) if p != port)
    assert main(["--model", "no-such-model", "--host", "127.0.0.1", "--port", str(port),
                 "--probe-port", str(probe_port), "--log-level", "error"]) == 1
    assert "no-such-model" in capsys.readouterr().err
