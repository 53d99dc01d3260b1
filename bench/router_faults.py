"""Faults through the router: streams across 4 sim daemons while 3 replicas are killed and one is frozen.

The router runs in this process (as in `stallfree up`), following the daemon set as a kubelet restarts
killed replicas on new ports. Faults: SIGKILL of three replicas at 20%, 45% and 70% of the run, and
SIGSTOP of another for --freeze-s (20 s) from 30%, then SIGCONT. Afterwards: every request has an
explicit outcome (completed, cancelled by its client, or failed), failures only on streams that were
already running on a replica when it was killed, none because of the frozen one, no request lost, no KV
block held anywhere; and how long the router took to notice each fault.
"""
from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from stallfree.arrivals import arrival_times
from stallfree.ready import wait_until_ready_async

SIM_ARGS = ["--backend", "sim", "--model", "llama-3-8b", "--hardware", "h100", "--max-model-len", "4096",
            "--max-token-budget", "1024", "--token-budget", "512", "--max-num-seqs-ceiling", "64",
            "--max-num-seqs", "64", "--num-kv-blocks", "2048", "--stats-window-s", "10",
            "--profile-max-seconds", "3", "--log-level", "warning"]


@dataclass
class FaultConfig:
    duration_s: float = 60.0
    rate: float = 20.0  # requests per second
    replicas: int = 4
    cancel_fraction: float = 0.1
    freeze_s: float = 20.0
    kill_at: tuple[float, ...] = (0.2, 0.45, 0.7)
    freeze_at: float = 0.3
    seed: int = 0


# The router's refusal of a request whose replica stopped answering right after it arrived (not retried elsewhere)
STOPPED_UNDER_IT = "stopped answering right after this request"


@dataclass
class Outcome:
    kind: str  # completed | cancelled | failed
    replica: str
    sent: float
    ended: float
    detail: str = ""
    max_gap_s: float = 0.0


@dataclass
class Fault:
    kind: str  # kill | freeze
    replica: str
    at: float
    until: float | None = None
    detected_after_s: float | None = None
    back_after_s: float | None = None


@dataclass
class FaultRun:
    config: FaultConfig
    workdir: Path
    outcomes: list[Outcome | None] = field(default_factory=list)
    faults: list[Fault] = field(default_factory=list)

    async def run(self) -> dict[str, Any]:
        from stallfree.operator.local.daemons import LocalDaemonSet
        from stallfree.operator.router.local import InProcessRouter
        from stallfree.operator.router.proxy import RouterConfig

        token = "bench-router-faults"
        config = self.config
        daemons = LocalDaemonSet("faults", SIM_ARGS, token, self.workdir / "logs", drain_timeout_s=5.0)
        router = InProcessRouter(token, RouterConfig(policy="slo-aware", chars_per_token=1.0))
        arrivals = list(arrival_times(config.rate, random.Random(config.seed), end=config.duration_s,
                                      first_at_start=True))
        self.outcomes = [None] * len(arrivals)
        daemons.scale_to(config.replicas)
        try:
            if not await asyncio.to_thread(daemons.wait_ready, 180):
                raise RuntimeError(f"daemons not ready; logs in {daemons.log_dir}")
            url = await router.start()
            router.follow({r.name: r.url for r in daemons.replicas})
            await wait_until_ready_async(lambda: len(router.router.pool.healthy()) >= config.replicas, 60.0,
                                         poll_s=0.1, what="the router's view of every replica")
            start = time.monotonic()
            stop = asyncio.Event()
            supervisor = asyncio.create_task(self._supervise(daemons, router, start, stop))
            faults = asyncio.create_task(self._inject(daemons, router, start))
            async with httpx.AsyncClient(timeout=httpx.Timeout(120.0, connect=3.0),
                                         limits=httpx.Limits(max_connections=1000),
                                         headers={"Authorization": f"Bearer {token}"}) as client:
                tasks = [asyncio.create_task(self._one(client, url, i, arrivals[i], start))
                         for i in range(len(arrivals))]
                await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), config.duration_s + 180)
            await faults
            stop.set()
            await supervisor
            await asyncio.to_thread(daemons.wait_ready, 120)
            kv = await self._kv_after(daemons, token)
        finally:
            await router.close()
            for replica in daemons.replicas:  # a replica left frozen by an error must still be stoppable
                if replica.alive:
                    os.kill(replica.process.pid, signal.SIGCONT)
            await asyncio.to_thread(daemons.shutdown)
        return self._summary(kv)

    async def _one(self, client: httpx.AsyncClient, url: str, index: int, arrival: float, start: float) -> None:
        delay = arrival - (time.monotonic() - start)
        if delay > 0:
            await asyncio.sleep(delay)
        rng = random.Random(self.config.seed * 7919 + index)
        cancel_after = rng.randint(1, 8) if rng.random() < self.config.cancel_fraction else None
        body = {"model": "llama-3-8b", "prompt": f"{index}: " + "word " * rng.randint(10, 400),
                "max_tokens": rng.randint(8, 64), "stream": True, "ignore_eos": True}
        sent = time.monotonic() - start
        replica, tokens, last, max_gap = "-", 0, None, 0.0

        def done(kind: str, detail: str = "") -> None:
            self.outcomes[index] = Outcome(kind, replica, sent, time.monotonic() - start, detail, max_gap)

        try:
            async with client.stream("POST", url + "/v1/completions", json=body) as response:
                replica = response.headers.get("x-stallfree-replica", "-")
                if response.status_code != 200:
                    return done("failed", f"HTTP {response.status_code}: {(await response.aread())[:120]!r}")
                async for line in response.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    now = time.monotonic()
                    if last is not None:
                        max_gap = max(max_gap, now - last)
                    last = now
                    data = line[5:].strip()
                    if data == "[DONE]":
                        return done("completed") if tokens else done("failed", "no tokens")
                    event = json.loads(data)
                    if "error" in event:
                        return done("failed", f"error event: {event['error'].get('code')}")
                    tokens += 1
                    if cancel_after is not None and tokens >= cancel_after:
                        return done("cancelled")
            done("failed", "stream ended without [DONE]")
        except (httpx.HTTPError, OSError) as exc:
            done("failed", type(exc).__name__)

    async def _inject(self, daemons, router, start: float) -> None:
        config = self.config
        schedule = sorted([(f * config.duration_s, "kill", i) for i, f in enumerate(config.kill_at)]
                          + [(config.freeze_at * config.duration_s, "freeze", len(config.kill_at))])
        for at, kind, index in schedule:
            await asyncio.sleep(max(0.0, at - (time.monotonic() - start)))
            replica = daemons.replicas[index % len(daemons.replicas)]
            now = time.monotonic() - start
            if kind == "kill":
                self.faults.append(Fault("kill", replica.name, now))
                await asyncio.to_thread(daemons.kill, replica.name)
            else:
                fault = Fault("freeze", replica.name, now, now + config.freeze_s)
                self.faults.append(fault)
                os.kill(replica.process.pid, signal.SIGSTOP)
                asyncio.get_running_loop().call_later(config.freeze_s, self._thaw, replica, fault, start)

    def _thaw(self, replica, fault: Fault, start: float) -> None:
        fault.until = time.monotonic() - start
        if replica.alive:
            os.kill(replica.process.pid, signal.SIGCONT)

    async def _supervise(self, daemons, router, start: float, stop: asyncio.Event) -> None:
        """A kubelet (restart the dead) and an endpoints controller (the router follows), plus stopwatches."""
        while not stop.is_set():
            daemons.restart_dead()
            router.follow({r.name: r.url for r in daemons.replicas if r.alive})
            now = time.monotonic() - start
            pool = router.router.pool.replicas
            for fault in self.faults:
                r = pool.get(fault.replica)
                healthy = r is not None and r.healthy
                if fault.detected_after_s is None and not healthy:
                    fault.detected_after_s = now - fault.at
                if fault.detected_after_s is not None and fault.back_after_s is None and healthy:
                    # For a freeze: back after the thaw; for a kill: the restarted process is ready.
                    fault.back_after_s = now - (fault.until if fault.kind == "freeze" and fault.until else fault.at)
            await asyncio.sleep(0.05)

    async def _kv_after(self, daemons, token: str) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        async with httpx.AsyncClient(headers={"Authorization": f"Bearer {token}"}, timeout=5.0) as client:
            for replica in daemons.replicas:
                stats: dict[str, Any] = {}
                for _ in range(60):
                    stats = (await client.get(replica.url + "/admin/stats")).json()
                    if stats["kv_usage"] == 0 and stats["num_running"] == 0 and stats["num_waiting"] == 0:
                        break
                    await asyncio.sleep(0.1)
                out[replica.name] = {"kv_usage": stats["kv_usage"], "running": stats["num_running"],
                                     "waiting": stats["num_waiting"]}
        return out

    def _explained(self, o: Outcome) -> bool:
        """A failure is expected only for a stream running on a replica when that replica was killed, or for a
        request the router refused (503) because the replica it had just reached stopped answering under it (a
        freeze or a kill, detected by the health check: the router does not retry a request that may be what
        froze its replica)."""
        if STOPPED_UNDER_IT in o.detail:
            return any(o.sent <= f.at + (f.detected_after_s or 2.0) and f.at <= o.ended for f in self.faults)
        return any(f.kind == "kill" and f.replica == o.replica and o.sent <= f.at <= o.ended + 0.5
                   for f in self.faults)

    def _summary(self, kv: dict[str, dict[str, Any]]) -> dict[str, Any]:
        done = [o for o in self.outcomes if o is not None]
        failed = [o for o in done if o.kind == "failed"]
        freeze = next((f for f in self.faults if f.kind == "freeze"), None)
        during_freeze = []
        if freeze is not None and freeze.detected_after_s is not None:
            lo, hi = freeze.at + freeze.detected_after_s, freeze.until or freeze.at + self.config.freeze_s
            during_freeze = [o for o in failed if lo <= o.sent <= hi and not self._explained(o)]
        stalled = [o for o in done if freeze is not None and o.replica == freeze.replica
                   and o.max_gap_s > 0.8 * self.config.freeze_s]
        reasons: dict[str, int] = {}
        for o in failed:
            key = f"{o.detail} ({'explained by a fault' if self._explained(o) else 'UNEXPLAINED'})"
            reasons[key] = reasons.get(key, 0) + 1
        return {
            "requests": len(self.outcomes), "completed": sum(o.kind == "completed" for o in done),
            "cancelled": sum(o.kind == "cancelled" for o in done), "failed": len(failed),
            "failed_explained_by_a_fault": sum(self._explained(o) for o in failed),
            "failed_unexplained": sum(not self._explained(o) for o in failed),
            "failed_unexplained_while_frozen": len(during_freeze),
            "streams_stalled_by_the_freeze": len(stalled),
            "lost": sum(o is None for o in self.outcomes),
            "leaked_kv_replicas": sum(1 for v in kv.values() if v["kv_usage"] != 0 or v["running"] or v["waiting"]),
            "kv_after": kv, "failure_reasons": reasons,
            "faults": [f.__dict__ for f in self.faults],
        }


def table(result: dict[str, Any]) -> list[str]:
    lines = [f"{'fault':<8}{'replica':<12}{'at s':>7}{'router noticed after':>22}{'back after':>12}"]
    for f in result["faults"]:
        noticed = "-" if f["detected_after_s"] is None else f"{f['detected_after_s']:.2f} s"
        back = "-" if f["back_after_s"] is None else f"{f['back_after_s']:.2f} s"
        lines.append(f"{f['kind']:<8}{f['replica']:<12}{f['at']:>7.1f}{noticed:>22}{back:>12}")
    lines.append("")
    for key in ("requests", "completed", "cancelled", "failed", "failed_explained_by_a_fault", "failed_unexplained",
                "failed_unexplained_while_frozen", "streams_stalled_by_the_freeze", "lost", "leaked_kv_replicas"):
        lines.append(f"{key:<34}{result[key]:>8}")
    for reason, count in result["failure_reasons"].items():
        lines.append(f"  {count} x {reason}")
    return lines
