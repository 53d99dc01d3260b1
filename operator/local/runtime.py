"""The local runtime: the operator's own control loop driving daemons that run as local processes.

Same ControlLoop, tuner and scaler as in the cluster; only the edges differ. Replicas are loopback
processes (local_daemons.py) instead of pods, the Actuator PUTs tuning over the same admin API and
scales the process set instead of patching a Deployment, and the loop's memory is a JSON file instead
of the InferenceService's status: a restarted `stallfree up` resumes from it without scaling twice.
"""
from __future__ import annotations

import asyncio
import json
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import httpx

from stallfree.contracts import Tuning
from stallfree.operator.control.loop import ControlLoop, ControlState, StepResult
from stallfree.operator.control.policy import ControlPolicy
from stallfree.operator.local.daemons import LocalDaemonSet, LocalReplica
from stallfree.operator.control.observe import ReplicaTarget
from stallfree.operator.control.observe_http import HttpObserver
from stallfree.operator.reconcile.render import daemon_args
from stallfree.operator.api.spec import InferenceServiceSpec
from stallfree.ready import ExitedBeforeReady, answers_ready_async, wait_until_ready_async


@dataclass(frozen=True)
class Event:
    t: float  # seconds since the runtime started
    reason: str
    message: str
    warning: bool = False


class LocalActuator:
    """Acts on local daemons through the same verbs the Kubernetes actuator uses."""

    def __init__(self, daemons: LocalDaemonSet, client: httpx.AsyncClient, admin_token: str,
                 on_event: Callable[[str, str, bool], None]) -> None:
        self.daemons = daemons
        self.client = client
        self.headers = {"Authorization": f"Bearer {admin_token}"}
        self.on_event = on_event

    async def put_tuning(self, replica: str, tuning: Tuning) -> None:
        target = _find(self.daemons.replicas, replica)
        response = await self.client.put(f"{target.url}/admin/tuning", json=tuning.to_dict(), headers=self.headers,
                                         timeout=3.0)
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {response.text[:200]}")

    async def set_replicas(self, replicas: int) -> None:
        self.daemons.scale_to(replicas)

    async def record_event(self, reason: str, message: str, warning: bool = False) -> None:
        self.on_event(reason, message, warning)


def _find(replicas: list[LocalReplica], name: str) -> LocalReplica:
    for replica in replicas:
        if replica.name == name:
            return replica
    raise LookupError(f"no replica named {name!r}")


class LocalRuntime:
    """One InferenceService run locally: its daemon set, its control loop and its recorded state."""

    def __init__(self, name: str, spec: InferenceServiceSpec, workdir: Path, policy: ControlPolicy | None = None,
                 threads_per_replica: int = 1, extra_daemon_args: list[str] | None = None,
                 state_file: Path | None = None) -> None:
        self.name = name
        self.spec = spec
        self.policy = policy or ControlPolicy.from_spec(spec)
        self.admin_token = secrets.token_urlsafe(24)
        self.daemons = LocalDaemonSet(name, daemon_args(spec) + list(extra_daemon_args or []), self.admin_token,
                                      workdir / "logs", threads_per_replica=threads_per_replica,
                                      drain_timeout_s=float(spec.engine.drain_timeout_seconds))
        self.state_file = state_file or workdir / "control-state.json"
        self.events: list[Event] = []
        self._ready_now: set[str] = set()  # names that answered /ready at the last look
        self.router = None  # an InProcessRouter once start_router() ran: the demo's load goes through it
        self.steps: list[StepResult] = []
        self.started = time.time()
        self.client = httpx.AsyncClient()
        self.loop = ControlLoop(self.policy, HttpObserver(self.client, self.admin_token,
                                                         min_samples=self.policy.min_samples),
                                LocalActuator(self.daemons, self.client, self.admin_token, self._event),
                                state=self._load_state())

    # -- lifecycle ------------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the recorded replica count (a resumed run) or the spec's."""
        recorded = self.loop.state.desired_replicas
        self.daemons.scale_to(recorded if recorded is not None else max(1, self.spec.desired_replicas()))

    async def wait_ready(self, timeout_s: float, on_wait: Callable[[float], None] | None = None) -> None:
        async def all_ready() -> bool:
            targets = await self.targets()
            return bool(targets) and all(t.ready for t in targets)

        try:
            await wait_until_ready_async(all_ready, timeout_s, poll_s=1.0, on_wait=on_wait,
                                         alive=lambda: all(r.alive for r in self.daemons.replicas),
                                         what=f"replicas (logs in {self.daemons.log_dir})")
        except ExitedBeforeReady:
            raise ExitedBeforeReady(f"{self.daemons.exited_text()} while starting") from None

    async def start_router(self, policy: str = "slo-aware") -> str:
        """`stallfree router` in this event loop, following the daemon set; returns its URL."""
        from stallfree.operator.router.local import InProcessRouter
        from stallfree.operator.router.proxy import RouterConfig

        from stallfree.operator.control.observe_router import RouterQueueSource
        from stallfree.operator.router.flow_control import FlowConfig, dispatch_wait_ms

        flow = FlowConfig(dispatch_wait_ms(self.policy.slo.queue_wait_p99_ms))
        self.router = InProcessRouter(self.admin_token, RouterConfig(policy=policy, flow=flow))
        url = await self.router.start()
        router = self.router.router

        async def read_queue() -> dict:
            return router.queue_status()

        self.loop.queue_source = RouterQueueSource(read_queue, self.policy.window_s)  # its backlog, to the scaler
        await self.targets()
        await self.router.wait_ready()
        return url

    async def close(self) -> None:
        if self.router is not None:
            await self.router.close()
        await asyncio.to_thread(self.daemons.shutdown)
        await self.client.aclose()

    # -- one control interval -------------------------------------------------------------------------
    async def step(self) -> StepResult:
        for name in self.daemons.restart_dead():
            self._event("ReplicaRestarted", f"{name}: the daemon process exited; restarted", True)
        for replica in self.daemons.reap():
            self._event("ReplicaRemoved", f"{replica.name}: drained and stopped")
        targets = await self.targets()
        result = await self.loop.step(targets, current_replicas=len(self.daemons.replicas), now=time.time())
        self.steps.append(result)
        self._save_state(result.state)
        return result

    async def targets(self) -> list[ReplicaTarget]:
        replicas = list(self.daemons.replicas)
        ready = await asyncio.gather(*(self._ready(r) for r in replicas))
        self._ready_now = {r.name for r, ok in zip(replicas, ready) if ok}
        if self.router is not None:
            self.router.follow({r.name: r.url for r in replicas if r.alive and not r.draining})
        return [ReplicaTarget(r.name, r.url, ok, instance=str(r.process.pid)) for r, ok in zip(replicas, ready)]

    def ready_urls(self) -> list[str]:
        """Where a client may send requests now: what a Service routes to (ready at the last look, not draining)."""
        return [r.url for r in self.daemons.replicas if r.name in self._ready_now and r.alive and not r.draining]

    def elapsed(self) -> float:
        return time.time() - self.started

    # -- internals ------------------------------------------------------------------------------------
    async def _ready(self, replica: LocalReplica) -> bool:
        return replica.alive and not replica.draining and await answers_ready_async(self.client, replica.url)

    def _event(self, reason: str, message: str, warning: bool = False) -> None:
        self.events.append(Event(round(self.elapsed(), 1), reason, message, warning))

    def _load_state(self) -> ControlState:
        if self.state_file.exists():
            try:
                return ControlState.from_dict(json.loads(self.state_file.read_text()))
            except (ValueError, TypeError, KeyError):
                pass  # a state file we cannot read is no worse than a fresh start
        return ControlState()

    def _save_state(self, state: ControlState) -> None:
        self.state_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(state.to_dict()))
        tmp.replace(self.state_file)  # atomic: a crash mid-write leaves the previous state
