"""A real daemon in-process for the server tests: the `stallfree serve` build path, uvicorn on a loopback port."""
from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass
from typing import Iterator

import torch
import uvicorn

from stallfree.node_daemon.server.app import Daemon
from stallfree.net import free_port
from stallfree.cli.serve import parse_options
from stallfree.node_daemon.daemon import build_daemon, probe_servers, start_engine, uvicorn_config
from stallfree.node_daemon.server.drain import DrainingServer

ADMIN_TOKEN = "test-admin-token"
# Small ceilings keep the tiny model's start-up profile to a second or two.
TINY_ARGS = ["--model", "tiny", "--device", "cpu", "--max-token-budget", "512", "--max-num-seqs-ceiling", "64",
             "--max-num-seqs", "64", "--token-budget", "256", "--num-kv-blocks", "2048",
             "--profile-max-seconds", "5"]


@dataclass
class LiveDaemon:
    daemon: Daemon
    url: str
    server: uvicorn.Server
    probe_url: str | None = None  # the probe listener (running_daemon(probes=True))

    @property
    def admin_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {ADMIN_TOKEN}"}

    @property
    def llm_engine(self):
        return self.daemon.engine.engine  # the AsyncEngine's LLMEngine (KV cache, scheduler)

    def wait_idle(self, timeout_s: float = 30.0) -> None:
        """Until the engine holds no request and every in-flight HTTP request closed."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if (not self.llm_engine.has_unfinished() and not self.daemon.drain.in_flight
                    and self.daemon.engine.num_in_flight == 0):
                return
            time.sleep(0.02)
        scheduler = self.llm_engine.scheduler
        raise AssertionError(f"daemon not idle after {timeout_s}s: {scheduler.num_running} running, "
                             f"{scheduler.num_waiting} waiting, {scheduler.num_paused} paused, "
                             f"{self.daemon.engine.num_in_flight} in the engine's hands, "
                             f"{len(self.daemon.drain.in_flight)} HTTP requests in flight")


@contextlib.contextmanager
def running_daemon(extra_args: list[str] = (), admin_token: str | None = ADMIN_TOKEN,
                   base_args: list[str] = TINY_ARGS, probes: bool = False) -> Iterator[LiveDaemon]:
    """probes: also the probe listener (on a free port, LiveDaemon.probe_url), started as `stallfree serve` does."""
    port = free_port()
    probe_args = ["--probe-port", str(next(p for p in iter(free_port, None) if p != port))] if probes else []
    with contextlib.ExitStack() as stack:
        stack.enter_context(_env("STALLFREE_ADMIN_TOKEN", admin_token))
        opts = parse_options([*base_args, "--log-level", "warning", *extra_args, "--host", "127.0.0.1",
                              "--port", str(port), *probe_args])
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # the test machine is shared: one intra-op thread keeps iterations steady
        daemon, app = build_daemon(opts)
        start_engine(opts, daemon)
        # The daemon's own connection limits; the probe listener rides on the serving loop as in run().
        server = DrainingServer(uvicorn_config(opts, daemon, app), daemon.drain, lambda rid: None,
                                companions=probe_servers(opts, daemon))
        thread = threading.Thread(target=server.run, name="test-uvicorn", daemon=True)
        thread.start()
        try:
            deadline = time.monotonic() + 20
            while not (server.started and all(c.started for c in server.companions)):
                if time.monotonic() > deadline or not thread.is_alive():
                    raise RuntimeError("uvicorn did not start")
                time.sleep(0.01)
            probe_url = f"http://127.0.0.1:{opts.probe_port}" if probes else None
            yield LiveDaemon(daemon, f"http://127.0.0.1:{port}", server, probe_url)
        finally:
            server.should_exit = True
            thread.join(timeout=10)
            daemon.engine.shutdown_sync()
            torch.set_num_threads(threads)


@contextlib.contextmanager
def _env(name: str, value: str | None):
    """Set (or with None, remove) an environment variable for the block."""
    import os

    old = os.environ.get(name)
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old
