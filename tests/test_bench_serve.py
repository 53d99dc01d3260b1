"""`stallfree bench serve` against a live `stallfree serve --backend sim` on loopback (bounded)."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import httpx
import pytest

from stallfree.bench import serve as bench_serve
from stallfree.loadgen.prompts import PromptBuilder
from stallfree.loadgen.run import summarize_results
from stallfree.loadgen.stream import RequestResult
from stallfree.node_daemon.sim.backend import build_cost_model
from stallfree.simulator.latency_summary import SLOs
from stallfree.simulator.workload import RequestSpec
from stallfree.net import free_port


@pytest.fixture(scope="module")
def sim_daemon():
    port = free_port()
    env = {**os.environ, "STALLFREE_ADMIN_TOKEN": "test-admin-token"}
    env.pop("STALLFREE_API_KEY", None)
    process = subprocess.Popen(
        [sys.executable, "-m", "stallfree.cli", "serve", "--backend", "sim", "--model", "llama-3-8b",
         "--hardware", "h100", "--host", "127.0.0.1", "--port", str(port), "--no-profile", "--max-model-len", "4096",
         "--num-kv-blocks", "4096", "--log-level", "warning"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            if process.poll() is not None:
                pytest.fail(f"stallfree serve exited: {process.stdout.read().decode()[-2000:]}")
            try:
                if httpx.get(url + "/ready", timeout=1.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail("stallfree serve --backend sim did not become ready in 60 s")
            time.sleep(0.2)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _run(capsys, argv: list[str]) -> tuple[int, dict]:
    code = bench_serve.main(argv + ["--json", "--no-progress"])
    return code, json.loads(capsys.readouterr().out)


def test_bench_measures_a_live_sim_daemon(sim_daemon, capsys, tmp_path):
    png = tmp_path / "bench.png"
    code, data = _run(capsys, ["--base-url", sim_daemon, "--num-requests", "12", "--rate", "40",
                               "--prompt-len", "fixed:200", "--output-len", "fixed:16", "--tokenizer", "llama-3-8b",
                               "--ttft-slo-ms", "60000", "--tpot-slo-ms", "60000", "--per-request", "--plot", str(png)])
    assert code == 0
    assert data["model"] == "llama-3-8b"  # discovered from /v1/models
    summary = data["summary"]
    assert summary["completed"] == 12 and summary["failed"] == 0
    assert all(r["output_tokens"] == 16 for r in data["requests"])  # ignore_eos + max_tokens, from usage
    assert all(abs(r["prompt_tokens"] - 200) <= 2 for r in data["requests"])
    # One gap per content chunk; a chunk may carry more than one token when the client reads late.
    assert 12 * 10 <= summary["itl_ms"]["count"] <= 12 * 15
    # The sim daemon paces tokens by the cost model: a decode step is at least one weight read plus overhead.
    step_ms = build_cost_model("llama-3-8b", "h100").predict_ms([216], [])
    assert summary["itl_ms"]["p50"] >= 0.8 * step_ms
    assert summary["ttft_ms"]["p50"] <= summary["e2e_ms"]["p50"]
    # Generous SLOs: every request is good, so goodput is the request throughput.
    assert summary["slo_attainment"] == 1.0
    assert summary["goodput"] == pytest.approx(summary["request_throughput"])
    assert png.stat().st_size > 10_000


def test_bench_chat_endpoint_and_strict_slos(sim_daemon, capsys):
    code, data = _run(capsys, ["--base-url", sim_daemon, "--endpoint", "chat", "--model", "llama-3-8b",
                               "--num-requests", "3", "--rate", "inf", "--prompt-len", "fixed:50",
                               "--output-len", "fixed:5", "--chars-per-token", "1", "--ttft-slo-ms", "0.001"])
    assert code == 0
    assert data["summary"]["completed"] == 3
    assert data["summary"]["goodput"] == 0.0 and data["summary"]["slo_attainment"] == 0.0


def test_bench_is_bounded_in_time_and_the_daemon_survives(sim_daemon, capsys):
    start = time.monotonic()
    code, data = _run(capsys, ["--base-url", sim_daemon, "--model", "llama-3-8b", "--num-requests", "4",
                               "--rate", "inf", "--prompt-len", "fixed:20", "--output-len", "fixed:3000",
                               "--chars-per-token", "1", "--timeout-s", "1.5"])
    assert time.monotonic() - start < 15
    assert code == 1  # nothing completed
    assert data["summary"]["completed"] == 0 and data["summary"]["failed"] == 4
    assert list(data["summary"]["errors"]) == ["not completed before the benchmark's time limit"]
    code, data = _run(capsys, ["--base-url", sim_daemon, "--model", "llama-3-8b", "--num-requests", "2",
                               "--rate", "inf", "--prompt-len", "fixed:20", "--output-len", "fixed:4",
                               "--chars-per-token", "1"])
    assert code == 0 and data["summary"]["completed"] == 2


def test_bench_reports_server_errors_per_request(sim_daemon, capsys):
    code, data = _run(capsys, ["--base-url", sim_daemon, "--model", "no-such-model", "--num-requests", "2",
                               "--rate", "inf", "--prompt-len", "fixed:10", "--output-len", "fixed:2"])
    assert code == 1
    (error,) = data["summary"]["errors"]
    assert error.startswith("HTTP 404") and data["summary"]["failed"] == 2


def test_bad_input_is_refused_before_any_load(capsys):
    assert bench_serve.main(["--base-url", f"http://127.0.0.1:{free_port()}", "--num-requests", "1"]) == 2
    assert "pass --model" in capsys.readouterr().err
    assert bench_serve.main(["--model", "m", "--output-len", "fixed:0"]) == 2
    assert "at least 1 token" in capsys.readouterr().err
    assert bench_serve.main(["--model", "m", "--timeout-s", "0"]) == 2


def test_prompt_builder_hits_lengths_and_keeps_prefixes_shared():
    builder = PromptBuilder(chars_per_token=1.0)
    a = builder.prompt(RequestSpec(0.0, 300, 4, shared_prefix_len=100), 0)
    b = builder.prompt(RequestSpec(0.0, 300, 4, shared_prefix_len=100), 1)
    assert len(a) == len(b) == 301  # prefix, a space, the rest
    assert a[:100] == b[:100] and a[101:] != b[101:]
    with pytest.raises(ValueError, match="chars_per_token"):
        PromptBuilder(chars_per_token=0)


def test_summary_percentiles_and_goodput():
    results = [RequestResult(i, 10, 5, 0.0, sent_s=0.0, ok=True, ttft_ms=10.0 * (i + 1),
                                         tpot_ms=5.0, e2e_ms=100.0, itl_ms=[5.0] * 4, output_tokens=5)
               for i in range(10)]
    results.append(RequestResult(10, 10, 5, 0.0, error="HTTP 500: boom"))
    summary = summarize_results(results, 1.0, SLOs(ttft_ms=50.0))
    assert summary["completed"] == 10 and summary["failed"] == 1
    assert summary["ttft_ms"]["p50"] == 50.0 and summary["ttft_ms"]["max"] == 100.0
    assert summary["slo_attainment"] == 0.5
    assert summary["goodput"] == pytest.approx(5 / 0.1)  # 5 good requests over the 100 ms they took
    assert summary["errors"] == {"HTTP 500: boom": 1}
