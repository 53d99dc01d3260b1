"""Serving daemons as local processes on loopback ports: the local runtime's stand-in for a Deployment.

The control loop acts on replicas through the same verbs it uses in a cluster (create, scale, drain,
delete); here a replica is a `stallfree serve` child process instead of a pod. A dead process is
restarted, as a kubelet would restart a crashed container.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from stallfree.net import free_port
from stallfree.ready import ExitedBeforeReady, NotReadyInTime, answers_ready, wait_until_ready


@dataclass
class LocalReplica:
    name: str
    port: int
    process: subprocess.Popen
    log_path: Path
    started_at: float = field(default_factory=time.monotonic)
    restarts: int = 0
    draining: bool = False
    drain_started: float = 0.0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def alive(self) -> bool:
        return self.process.poll() is None


class LocalDaemonSet:
    """Keeps `desired` replicas of one service running; ordinal names like a StatefulSet (svc-0, svc-1...)."""

    def __init__(self, service: str, daemon_args: list[str], admin_token: str, log_dir: Path,
                 threads_per_replica: int = 1, extra_env: dict[str, str] | None = None,
                 drain_timeout_s: float = 30.0) -> None:
        self.service = service
        self.daemon_args = list(daemon_args)
        self.admin_token = admin_token
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.threads_per_replica = threads_per_replica
        self.extra_env = dict(extra_env or {})
        self.drain_timeout_s = drain_timeout_s
        self.replicas: list[LocalReplica] = []
        self.draining: list[LocalReplica] = []
        self.total_restarts = 0

    # -- verbs the control loop and the runtime use ---------------------------------------------
    def scale_to(self, desired: int) -> None:
        """Start missing replicas now; surplus ones (newest first) start draining and leave the set.

        Draining is not awaited here: the daemon finishes its in-flight requests within its own grace
        period and exits; `reap()` collects it (and kills one that overstays `drain_timeout_s`).
        """
        while len(self.replicas) < desired:
            self.replicas.append(self._spawn(self._next_name()))
        while len(self.replicas) > desired:
            replica = self.replicas.pop()
            self.begin_drain(replica)
            self.draining.append(replica)

    def begin_drain(self, replica: LocalReplica) -> None:
        """SIGTERM lets the daemon drain: it refuses new requests and finishes in-flight ones, then exits."""
        replica.draining = True
        replica.drain_started = time.monotonic()
        if replica.alive:
            replica.process.send_signal(signal.SIGTERM)

    def reap(self) -> list[LocalReplica]:
        """Drained replicas that have exited (or were killed for overstaying); they are gone for good."""
        gone = []
        for replica in list(self.draining):
            if replica.alive and time.monotonic() - replica.drain_started > self.drain_timeout_s + 5:
                replica.process.kill()
            if not replica.alive:
                replica.process.wait()
                self.draining.remove(replica)
                gone.append(replica)
        return gone

    def restart_dead(self) -> list[str]:
        """Restart every replica whose process exited (not ones we are draining). Returns their names."""
        restarted = []
        for index, replica in enumerate(self.replicas):
            if not replica.alive and not replica.draining:
                fresh = self._spawn(replica.name)
                fresh.restarts = replica.restarts + 1
                self.replicas[index] = fresh
                self.total_restarts += 1
                restarted.append(replica.name)
        return restarted

    def ready(self, replica: LocalReplica, timeout_s: float = 1.0) -> bool:
        return replica.alive and not replica.draining and answers_ready(replica.url, timeout_s)

    def wait_ready(self, timeout_s: float = 180.0) -> bool:
        """True once every replica answers /ready; False at the deadline. A replica that exits while starting
        raises ExitedBeforeReady (a RuntimeError) at once."""
        try:
            wait_until_ready(lambda: bool(self.replicas) and all(self.ready(r) for r in self.replicas), timeout_s,
                             alive=lambda: all(r.alive for r in self.replicas), poll_s=0.5,
                             what=f"a replica of {self.service}")
        except NotReadyInTime:
            return False
        except ExitedBeforeReady:
            raise ExitedBeforeReady(f"{self.exited_text()} while starting") from None
        return True

    def exited_text(self) -> str:
        """Which replicas' processes have exited, and where their logs are."""
        dead = [f"{r.name} (its log: {r.log_path})" for r in self.replicas if not r.alive]
        return f"replica {', '.join(dead) or 'none'} exited"

    def kill(self, name: str) -> None:
        """Hard-kill a replica (fault injection): it is restarted by restart_dead()."""
        for replica in self.replicas:
            if replica.name == name and replica.alive:
                replica.process.kill()
                replica.process.wait()

    def begin_drain_all(self) -> None:
        """SIGTERM every replica at once (they refuse new work and finish in-flight requests); shutdown() waits."""
        for replica in self.replicas:
            if not replica.draining:
                self.begin_drain(replica)

    def shutdown(self) -> None:
        """Drain every replica at once and wait for all of them (killing any that overstay their grace)."""
        self.begin_drain_all()
        self.draining.extend(self.replicas)
        self.replicas.clear()
        started = min((r.drain_started for r in self.draining), default=time.monotonic())
        deadline = started + self.drain_timeout_s + 5
        for replica in self.draining:
            try:
                replica.process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                replica.process.kill()
                replica.process.wait()
        self.draining.clear()

    # -- internals --------------------------------------------------------------------------------
    def _cores_for(self, name: str) -> set[int] | None:
        """Cores of its own for each replica where the machine has them (as one daemon per node): replica i
        takes the i-th group of `threads_per_replica` cores, so two replicas never share a core's time."""
        try:
            allowed = sorted(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            return None
        ordinal = int(name.rsplit("-", 1)[1]) if name.rsplit("-", 1)[-1].isdigit() else 0
        groups = len(allowed) // self.threads_per_replica
        if groups < 2:
            return None  # one group only: nothing to keep apart
        start = (ordinal % groups) * self.threads_per_replica
        return set(allowed[start:start + self.threads_per_replica])

    def _next_name(self) -> str:
        taken = {r.name for r in self.replicas}
        ordinal = 0
        while f"{self.service}-{ordinal}" in taken:
            ordinal += 1
        return f"{self.service}-{ordinal}"

    def _spawn(self, name: str) -> LocalReplica:
        port = free_port()
        env = dict(os.environ)
        env.update(self.extra_env)
        env["STALLFREE_ADMIN_TOKEN"] = self.admin_token
        # One replica per core, as one daemon per GPU node: replicas must not fight over threads.
        env["OMP_NUM_THREADS"] = str(self.threads_per_replica)
        log_path = self.log_dir / f"{name}.log"
        log = open(log_path, "ab")
        cmd = [sys.executable, "-m", "stallfree.cli", "serve", *self.daemon_args,
               "--threads", str(self.threads_per_replica), "--host", "127.0.0.1", "--port", str(port)]
        cores = self._cores_for(name)
        process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                   preexec_fn=(lambda: os.sched_setaffinity(0, cores)) if cores else None)
        log.close()
        return LocalReplica(name=name, port=port, process=process, log_path=log_path)
