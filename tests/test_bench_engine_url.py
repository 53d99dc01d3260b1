"""`stallfree bench engine --url ... --launch ...` against a sim daemon on loopback, and its pieces."""
from __future__ import annotations

import json
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest

from stallfree.bench import engine as bench_engine
from stallfree.bench.engine_compare import compare
from stallfree.bench.engine_streams import LONG_GENERATION_TAIL, Target
from stallfree.bench.engine_url import URL_LABELS, probe_ignore_eos
from stallfree.bench.launch import Launched, launch, process_tree, tree_memory_kb


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.slow
def test_bench_engine_url_launches_a_sim_daemon_and_writes_every_row(tmp_path, capsys) -> None:
    port = _free_port()
    out = tmp_path / "sim.json"
    serve = [sys.executable, "-m", "stallfree.cli", "serve", "--backend", "sim", "--model", "llama-3-8b",
             "--port", str(port), "--no-profile-cache"]
    assert bench_engine.main(["--quick", "--startup-repeats", "2", "--url", f"http://127.0.0.1:{port}",
                              "--model", "llama-3-8b", "--label", "sim", "--output", str(out),
                              "--launch", *serve]) == 0
    printed = capsys.readouterr().out
    data = json.loads(out.read_text())
    rows, sizes = data["rows"], data["sizes"]
    assert data["mode"] == "url" and data["launch"] == serve and rows["ignore_eos"] is True
    for key in URL_LABELS:
        assert rows[key]["value"] > 0, key
        assert URL_LABELS[key].format(**sizes) in printed
    assert rows["single_stream_decode_tok_s"]["tokens_produced"] == [sizes["decode_tokens"]]  # ignore_eos held
    assert rows["concurrent_total_tok_s"]["tokens_produced"] == [sizes["streams"] * sizes["decode_tokens"]]
    assert rows["long_prompt_ttft_ms"]["prompt_tokens"] == [sizes["long_prompt"]]  # prompts of exact length
    assert all(run["gaps_during"] > 0 for run in rows["landing_max_gap_ms"]["runs"])  # streams decoded meanwhile
    assert len(rows["startup_s"]["runs"]) == 2
    assert rows["peak_rss_mb"]["after_streams"]["peak_rss_mb"] > 0
    with httpx.Client() as client:  # every start was stopped
        with pytest.raises(httpx.ConnectError):
            client.get(f"http://127.0.0.1:{port}/health")
    other = tmp_path / "other.json"
    other.write_text(json.dumps({**data, "label": "other"}))
    table = compare([str(out), str(other)])
    assert "| sim | other | sim vs other |" in table and "1.00x" in table


def test_compare_takes_the_median_of_each_servers_rounds(tmp_path) -> None:
    def run(label: str, tok_s: float, ttft_ms: float) -> str:
        rows = {key: {"value": None, "unit": "x", "note": "needs --launch"} for key in URL_LABELS}
        rows["single_stream_decode_tok_s"] = {"value": tok_s, "unit": "tok/s"}
        rows["long_prompt_ttft_ms"] = {"value": ttft_ms, "unit": "ms"}
        path = tmp_path / f"{label}-{tok_s}.json"
        path.write_text(json.dumps({"mode": "url", "label": label, "sizes": bench_engine.Sizes().__dict__,
                                    "rows": rows}))
        return str(path)

    # Alternating rounds: A's median 100 tok/s and 2,000 ms, B's 50 tok/s and 4,000 ms.
    paths = [run("A", 90, 2500), run("B", 50, 4000), run("A", 100, 2000), run("B", 40, 3000), run("A", 120, 1000),
             run("B", 60, 5000)]
    table = compare(paths)
    assert "| one stream, 128 tokens | 100 tok/s | 50.00 tok/s | 2.00x |" in table  # faster: higher is better
    assert "| 1500-token prompt alone, TTFT | 2,000 ms | 4,000 ms | 2.00x |" in table  # shorter: lower is better
    assert "A: 3, B: 3" in table


def test_without_launch_the_process_rows_say_what_they_need(tmp_path) -> None:
    from stallfree.bench.engine_url import fmt

    assert fmt({"value": None, "unit": "s", "note": "needs --launch"}) == "- (needs --launch)"


def test_ignore_eos_is_dropped_only_when_the_server_refuses_it() -> None:
    def server(refuses: bool):
        def handle(request: httpx.Request) -> httpx.Response:
            body = json.loads(request.content)
            return httpx.Response(400 if refuses and "ignore_eos" in body else 200, json={})
        return httpx.Client(transport=httpx.MockTransport(handle))

    assert probe_ignore_eos(server(False), "http://x", "m", "auto") is True
    assert probe_ignore_eos(server(True), "http://x", "m", "auto") is False
    assert probe_ignore_eos(server(False), "http://x", "m", "off") is False


def test_without_ignore_eos_the_body_asks_for_a_long_generation() -> None:
    body = Target("http://x", "m", ignore_eos=False).body("words", 128)
    assert "ignore_eos" not in body and body["prompt"] == "words" + LONG_GENERATION_TAIL
    assert body["temperature"] == 0.0 and body["max_tokens"] == 128
    assert Target("http://x", "m").body("words", 128)["ignore_eos"] is True


def test_the_tree_counts_a_forked_worker_and_stop_ends_it(tmp_path) -> None:
    # A leader that forks a worker, prints the worker's pid, then blocks on stdin like a server would.
    leader = textwrap.dedent("""
        import subprocess, sys
        worker = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
        print(worker.pid, flush=True)
        sys.stdin.read()
    """)
    process = subprocess.Popen([sys.executable, "-c", leader], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               start_new_session=True)
    worker = int(process.stdout.readline())
    launched = Launched(process, tmp_path / "log")
    try:
        assert worker in process_tree(process.pid)
        rss, hwm, count = tree_memory_kb(process.pid)
        assert count == 2 and hwm >= rss > 0
    finally:
        launched.stop(timeout_s=10)
    assert process.poll() is not None
    assert _ended(worker)


def _ended(pid: int, timeout_s: float = 10.0) -> bool:
    """Gone or a zombie (killed; init reaps it when it gets to it), polled up to `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return True
        if stat[stat.rindex(")") + 2] in "ZX":
            return True
        time.sleep(0.01)
    return False


def test_a_command_that_exits_is_an_error_with_its_log(tmp_path) -> None:
    cmd = [sys.executable, "-c", "print('no model here'); raise SystemExit(3)"]
    with pytest.raises(RuntimeError, match="exited with 3(.|\n)*no model here"):
        launch(cmd, f"http://127.0.0.1:{_free_port()}", "m", tmp_path / "log", timeout_s=60)
