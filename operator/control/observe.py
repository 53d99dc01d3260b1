"""Observe replicas: each ready daemon's /admin/stats window and /admin/profile, with timeouts.

A replica the loop cannot trust is *unknown*, with the reason: not ready, a failed or timed-out scrape,
or too few latency samples in its window. Unknown never means healthy and never means idle; the tuner
and the scaler refuse to rest a decision on it. A scrape that failed to give latency but did return the
replica's current tuning still reports that tuning, so a restarted replica can be re-tuned at once.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Protocol, Sequence

import httpx

from stallfree.contracts import Profile, Tuning, WindowStats

NOT_READY = "not ready"


@dataclass(frozen=True)
class ReplicaTarget:
    """One replica the loop should look at. `instance` changes when the replica restarts (pod uid, pid)."""

    name: str
    url: str | None = None  # base URL of the daemon (admin API); None where the observer needs none
    ready: bool = True
    instance: str = ""


@dataclass(frozen=True)
class ReplicaObservation:
    name: str
    ready: bool
    stats: WindowStats | None  # None when nothing could be read
    profile: Profile | None
    unknown_reason: str | None  # None: known (a readable window with enough samples)
    instance: str = ""

    @property
    def known(self) -> bool:
        return self.unknown_reason is None

    @property
    def tuning(self) -> Tuning | None:
        """The tuning the replica runs now, when its stats could be read (even with too few samples)."""
        return self.stats.tuning if self.stats is not None else None


class Observer(Protocol):
    async def observe(self, targets: Sequence[ReplicaTarget], now: float) -> list[ReplicaObservation]: ...


def too_few_samples(stats: WindowStats, min_samples: int) -> str | None:
    """The reason a window cannot carry a decision, or None when it can."""
    counts = {"TTFT": stats.ttft_ms.count, "TPOT": stats.tpot_ms.count}
    short = [f"{name} {count}" for name, count in counts.items() if count < min_samples]
    if short:
        return f"too few samples in {stats.window_s:g}s window ({', '.join(short)} < {min_samples})"
    return None


def classify(target: ReplicaTarget, stats: WindowStats | None, profile: Profile | None, min_samples: int,
             failure: str | None = None) -> ReplicaObservation:
    """One observation from what could be read: unknown unless ready, read and sampled enough."""
    if not target.ready:
        reason: str | None = NOT_READY
    elif stats is None:
        reason = failure or "stats unavailable"
    else:
        reason = too_few_samples(stats, min_samples)
    return ReplicaObservation(target.name, target.ready, stats, profile, reason, target.instance)


class HttpObserver:
    """Reads each ready replica's admin API concurrently; every request has a timeout."""

    def __init__(self, client: httpx.AsyncClient, admin_token: str | None, timeout_s: float = 2.0,
                 min_samples: int = 5) -> None:
        self.client = client
        self.headers = {"Authorization": f"Bearer {admin_token}"} if admin_token else {}
        self.timeout_s = timeout_s
        self.min_samples = min_samples

    async def observe(self, targets: Sequence[ReplicaTarget], now: float) -> list[ReplicaObservation]:
        return list(await asyncio.gather(*(self._observe_one(t) for t in targets)))

    async def _observe_one(self, target: ReplicaTarget) -> ReplicaObservation:
        if not target.ready or target.url is None:
            return classify(target, None, None, self.min_samples, NOT_READY if not target.ready else "no address")
        stats_result, profile_result = await asyncio.gather(
            self._get(target.url, "/admin/stats"), self._get(target.url, "/admin/profile"))
        stats = profile = None
        failure = None
        if isinstance(stats_result, str):
            failure = f"stats scrape failed: {stats_result}"
        else:
            try:
                stats = WindowStats.from_dict(stats_result)
            except (KeyError, TypeError, ValueError) as exc:
                failure = f"stats malformed: {exc!r}"
        if not isinstance(profile_result, str):
            try:
                profile = Profile.from_dict(profile_result)
            except (KeyError, TypeError, ValueError):
                profile = None  # a replica without a usable profile is still observable
        return classify(target, stats, profile, self.min_samples, failure)

    async def _get(self, base_url: str, path: str) -> dict | str:
        """The JSON body, or a one-line reason why there is none."""
        try:
            response = await self.client.get(base_url.rstrip("/") + path, headers=self.headers,
                                             timeout=self.timeout_s)
        except httpx.TimeoutException:
            return f"timed out after {self.timeout_s:g}s"
        except httpx.HTTPError as exc:
            return f"{type(exc).__name__}: {exc}"
        if response.status_code != 200:
            return f"HTTP {response.status_code}"
        try:
            body = response.json()
        except ValueError:
            return "body is not JSON"
        return body if isinstance(body, dict) else "body is not a JSON object"
