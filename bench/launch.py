"""A server process `bench engine --launch` starts: time to its first answer and the RSS of its process tree.

The command runs in a session of its own, so stopping it reaches the workers it forks (vLLM runs 4 processes).
RSS is the sum of VmRSS over the tree, sampled on a thread every `sample_s` from the start until it stops; the
sum of each process's VmHWM is kept too (an upper bound: the processes need not peak at the same moment).
"""
from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from stallfree.ready import ExitedBeforeReady, NotReadyInTime, wait_until_ready

__all__ = ["Launched", "launch", "process_tree", "tree_memory_kb"]


def _children() -> dict[int, list[int]]:
    """ppid -> pids, from /proc (processes that vanish while being read are skipped)."""
    kids: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(")") + 2:].split()[1])  # the name may hold spaces and parentheses
        kids.setdefault(ppid, []).append(int(entry))
    return kids


def process_tree(pid: int) -> list[int]:
    kids, tree, todo = _children(), [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        todo += kids.get(p, [])
    return tree


def tree_memory_kb(pid: int) -> tuple[int, int, int]:
    """(sum of VmRSS, sum of VmHWM, processes) over `pid` and its descendants, in KiB."""
    rss = hwm = count = 0
    for p in process_tree(pid):
        try:
            lines = Path(f"/proc/{p}/status").read_text().splitlines()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in lines if ":" in line)
        if "VmRSS" not in fields:  # a zombie
            continue
        rss += int(fields["VmRSS"].split()[0])
        hwm += int(fields.get("VmHWM", "0 kB").split()[0])
        count += 1
    return rss, hwm, count


@dataclass
class Launched:
    process: subprocess.Popen
    log_path: Path
    sample_s: float = 0.2
    first_answer_s: float = float("nan")
    peak_rss_kb: int = 0
    peak_hwm_kb: int = 0
    peak_processes: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start_sampling(self) -> None:
        self._thread = threading.Thread(target=self._sample, name="rss-sampler", daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.is_set() and self.process.poll() is None:
            self.sample()
            self._stop.wait(self.sample_s)

    def sample(self) -> None:
        rss, hwm, count = tree_memory_kb(self.process.pid)
        self.peak_rss_kb = max(self.peak_rss_kb, rss)
        self.peak_hwm_kb = max(self.peak_hwm_kb, hwm)
        self.peak_processes = max(self.peak_processes, count)

    def memory_mb(self) -> dict[str, float | int]:
        self.sample()
        return {"peak_rss_mb": self.peak_rss_kb / 1024.0, "sum_vmhwm_mb": self.peak_hwm_kb / 1024.0,
                "processes": self.peak_processes}

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM to the whole session, SIGKILL past `timeout_s`."""
        self._stop.set()
        if self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        try:  # workers the leader left behind
            os.killpg(self.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if self._thread is not None:
            self._thread.join(timeout=5.0)


def answers(client: httpx.Client, url: str, model: str) -> bool:
    body = {"model": model, "prompt": "Hello", "max_tokens": 1, "temperature": 0.0}
    try:
        return client.post(url + "/v1/completions", json=body).status_code == 200
    except httpx.HTTPError:
        return False


def launch(cmd: list[str], url: str, model: str, log_path: Path, timeout_s: float, poll_s: float = 0.05) -> Launched:
    """Start `cmd`, poll a one-token completion until it answers 200; first_answer_s is from Popen to then."""
    with open(log_path, "wb") as log:
        started = time.perf_counter()
        process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   start_new_session=True)
    launched = Launched(process, log_path)
    launched.start_sampling()
    with httpx.Client(timeout=30.0) as client:
        try:
            wait_until_ready(lambda: answers(client, url, model), max(0.0, started + timeout_s - time.perf_counter()),
                             alive=lambda: process.poll() is None, poll_s=poll_s, what=f"`{' '.join(cmd)}`")
        except ExitedBeforeReady:
            launched.stop()
            raise RuntimeError(f"`{' '.join(cmd)}` exited with {process.returncode}:\n"
                               f"{launched.log_text()[-3000:]}") from None
        except NotReadyInTime:
            launched.stop()
            raise RuntimeError(f"`{' '.join(cmd)}` did not answer at {url} within {timeout_s:g} s") from None
    launched.first_answer_s = time.perf_counter() - started
    return launched
