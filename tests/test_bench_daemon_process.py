"""bench's daemon child: output to a log file (a full stderr pipe blocks the daemon), the log's tail on failure."""
from __future__ import annotations

import sys
import time

import pytest

from stallfree.bench.daemon_process import log_tail, start, stop, wait_ready
from stallfree.net import free_port

# A child that writes 256 KiB to stderr (four times a pipe's buffer) before it serves /ready.
NOISY_SERVER = """
import sys
from http.server import BaseHTTPRequestHandler, HTTPServer
for _ in range(256):
    sys.stderr.write("W" * 1023 + "\\n")
sys.stderr.flush()
class Ready(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()
    def log_message(self, *a):
        pass
HTTPServer(("127.0.0.1", int(sys.argv[1])), Ready).serve_forever()
"""


def test_a_daemon_writing_past_a_pipe_buffer_to_stderr_still_gets_ready(tmp_path):
    port = free_port()
    process, log_path = start([sys.executable, "-c", NOISY_SERVER, str(port)], log_path=tmp_path / "d.log")
    try:
        wait_ready(process, f"http://127.0.0.1:{port}", timeout_s=20, poll_s=0.05, log_path=log_path)
        assert log_path.stat().st_size >= 256 * 1024
    finally:
        stop(process, timeout_s=5)


def test_a_daemon_that_exits_raises_with_the_end_of_its_log(tmp_path):
    cmd = [sys.executable, "-c", "import sys; sys.stderr.write('x' * 100000 + 'model file not found'); sys.exit(3)"]
    process, log_path = start(cmd, log_path=tmp_path / "d.log")
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="exited before it was ready(.|\n)*model file not found") as caught:
        wait_ready(process, f"http://127.0.0.1:{free_port()}", timeout_s=30, poll_s=0.05, log_path=log_path)
    assert time.monotonic() - started < 10 and len(str(caught.value)) < 3000


def test_a_daemon_that_never_gets_ready_is_killed_at_the_deadline(tmp_path):
    process, log_path = start([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        with pytest.raises(RuntimeError, match="not ready after"):
            wait_ready(process, f"http://127.0.0.1:{free_port()}", timeout_s=0.5, poll_s=0.1, log_path=log_path)
        assert process.poll() is not None  # killed, not left behind
    finally:
        log_path.unlink(missing_ok=True)


def test_log_tail_of_a_missing_file_says_so(tmp_path):
    assert "cannot read" in log_tail(tmp_path / "none.log")
