"""The replicas behind the router and what it last saw of each: health, stats, profile, its own sends.

A poller per replica asks /ready and /admin/stats every `poll_interval_s` with a short timeout. A replica
that is not ready, draining, or does not answer in time (a hung process: SIGSTOP, a wedged event loop,
not only a dead one) stops taking requests at that poll and takes them again at the first poll it
answers. The profile is read once per process start (after a replica was down it is read again).
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import httpx

from stallfree.contracts import Profile, WindowStats
from stallfree.operator.router.pick import ReplicaView
from stallfree.operator.router.prefill_clock import PrefillClock
from stallfree.operator.router.rates import decode_step_ms, prefill_tokens_per_ms
from stallfree.operator.router.startup_times import StartupTimes

log = logging.getLogger("stallfree.router")


@dataclass
class Replica:
    name: str
    url: str
    healthy: bool = False
    reason: str = "not polled yet"
    stats: WindowStats | None = None
    profile: Profile | None = None
    # What it serves, from its /v1/models (read with the profile): model id -> context length (0: not said).
    models: dict[str, int] | None = None
    # What the router sent it and has not had a first byte back for, drained at its prefill rate.
    clock: PrefillClock = field(default_factory=PrefillClock)
    outstanding: int = 0
    # In flight there by the router's key (ticket) -> its priority: the running slots each band holds.
    held: dict = field(default_factory=dict)
    last_sent: int = 0  # the ticket of the request sent there last: the suspect when it stops answering
    sequences: dict = field(default_factory=dict)  # ticket -> its n, for the requests of more than one choice
    down_event: asyncio.Event = field(default_factory=asyncio.Event)
    removed: bool = False
    # From its first sight until its first ready poll (time.monotonic), and whether it was seen loading its model
    # meanwhile (then that span was a start-up: ReplicaPool.startup_times learns from it).
    seen_at: float = field(default_factory=time.monotonic)
    ever_ready: bool = False
    seen_loading: bool = False

    @property
    def starting(self) -> bool:
        return not self.healthy and not self.removed and not self.ever_ready and \
            self.reason in ("loading model", "not polled yet")

    def mark(self, healthy: bool, reason: str) -> None:
        if healthy != self.healthy:
            log.info("replica %s %s%s", self.name, "healthy" if healthy else "unhealthy",
                     "" if healthy else f": {reason}")
        if not healthy:
            self.down_event.set()
        elif not self.healthy:
            self.down_event = asyncio.Event()
        self.healthy, self.reason = healthy, reason

    def prefill_tokens_per_ms(self) -> float:
        return prefill_tokens_per_ms(self.profile, self.stats)

    def view(self, now_s: float, cached_prefix_tokens: int = 0, home: bool = False) -> ReplicaView:
        stats = self.stats
        rate = self.prefill_tokens_per_ms()
        by_priority: dict[int, int] = {}
        for ticket, priority in self.held.items():
            by_priority[priority] = by_priority.get(priority, 0) + self.sequences.get(ticket, 1)
        return ReplicaView(
            name=self.name,
            queued_prefill_tokens=self.clock.queued_tokens(rate * 1000.0, now_s),
            queued_by_class=self.clock.queued_by_class(rate * 1000.0, now_s),
            # The engine preempts a lower band for a higher one's slot (scheduler.py): slots counted per band.
            outstanding_by_priority=by_priority if sum(by_priority.values()) == self.outstanding else None,
            prefill_tokens_per_ms=rate,
            step_ms=decode_step_ms(self.profile, stats),
            outstanding=self.outstanding,
            cached_prefix_tokens=cached_prefix_tokens,
            home=home,
            max_num_seqs=stats.tuning.max_num_seqs if stats is not None else None,
        )


class ReplicaPool:
    def __init__(self, admin_token: str | None, poll_interval_s: float = 0.25, timeout_s: float = 0.5,
                 on_change=None) -> None:
        self.replicas: dict[str, Replica] = {}
        self.poll_interval_s = poll_interval_s
        self.timeout_s = timeout_s
        self.admin_token = admin_token  # also what a client shows to see replica addresses (proxy.py)
        self._headers = {"Authorization": f"Bearer {admin_token}"} if admin_token else {}
        self._client: httpx.AsyncClient | None = None
        self._tasks: dict[str, asyncio.Task] = {}
        self._on_change = on_change  # called with (replica) when health flips or it leaves
        self.startup_times = StartupTimes()

    def starting_in_ms(self, now: float) -> list[float]:
        """When each replica still starting is expected ready, from `now` (time.monotonic), in ms
        (startup_times.py; one starting for too long is not counted)."""
        out = []
        for replica in self.replicas.values():
            if replica.starting:
                ready_in = self.startup_times.ready_in_ms(now - replica.seen_at)
                if ready_in is not None:
                    out.append(ready_in)
        return out

    def healthy(self) -> list[Replica]:
        return [r for r in self.replicas.values() if r.healthy]

    async def start(self) -> None:
        self._client = httpx.AsyncClient(timeout=httpx.Timeout(self.timeout_s), headers=self._headers,
                                         limits=httpx.Limits(max_keepalive_connections=64))

    async def close(self) -> None:
        for task in self._tasks.values():
            task.cancel()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)
        self._tasks.clear()
        if self._client is not None:
            await self._client.aclose()

    def set_replicas(self, urls: dict[str, str]) -> None:
        """name -> base URL; new ones start polling, missing ones leave (their in-flight requests finish)."""
        for name in list(self.replicas):
            if name not in urls or self.replicas[name].url != urls[name]:
                replica = self.replicas.pop(name)
                replica.removed = True
                replica.mark(False, "removed")
                task = self._tasks.pop(name, None)
                if task is not None:
                    task.cancel()
                if self._on_change:
                    self._on_change(replica)
        for name, url in urls.items():
            if name not in self.replicas:
                replica = Replica(name, url.rstrip("/"))
                self.replicas[name] = replica
                self._tasks[name] = asyncio.get_running_loop().create_task(self._poll_forever(replica))

    async def _poll_forever(self, replica: Replica) -> None:
        while not replica.removed:
            started = time.monotonic()
            was_healthy = replica.healthy
            try:
                await self.poll(replica)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - any failure to answer is unhealthy, never a crash
                replica.mark(False, f"{type(exc).__name__}: {exc}"[:200])
            self._track_startup(replica, time.monotonic())
            if replica.healthy != was_healthy and self._on_change:
                self._on_change(replica)
            await asyncio.sleep(max(0.0, self.poll_interval_s - (time.monotonic() - started)))

    def _track_startup(self, replica: Replica, now: float) -> None:
        if replica.ever_ready:
            return
        if replica.healthy:
            replica.ever_ready = True
            if replica.seen_loading:
                self.startup_times.observed(now - replica.seen_at)
        elif replica.reason == "loading model":
            replica.seen_loading = True

    async def poll(self, replica: Replica) -> None:
        assert self._client is not None
        ready = await self._client.get(f"{replica.url}/ready")
        if ready.status_code != 200:
            reason = "not ready"
            try:
                reason = ready.json().get("reason") or reason
            except ValueError:
                pass
            if reason == "loading model":
                replica.profile = replica.models = None
            replica.mark(False, reason)
            return
        if replica.profile is None or not replica.healthy:
            response = await self._client.get(f"{replica.url}/admin/profile")
            replica.profile = Profile.from_dict(response.json()) if response.status_code == 200 else None
            replica.models = await self._models(replica)
        response = await self._client.get(f"{replica.url}/admin/stats")
        if response.status_code != 200:
            replica.mark(False, f"/admin/stats answered {response.status_code}")
            return
        replica.stats = WindowStats.from_dict(response.json())
        replica.mark(True, "ready")

    async def _models(self, replica: Replica) -> dict[str, int] | None:
        """model id -> context length from the replica's /v1/models; None when it does not say."""
        assert self._client is not None
        response = await self._client.get(f"{replica.url}/v1/models")
        try:
            data = response.json()["data"] if response.status_code == 200 else None
            return {m["id"]: int(m.get("max_model_len") or 0) for m in data if isinstance(m.get("id"), str)} \
                if isinstance(data, list) and data else None
        except (ValueError, KeyError, TypeError, AttributeError):
            return None
