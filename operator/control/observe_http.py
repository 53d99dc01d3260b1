"""HttpObserver: each ready daemon's /admin/stats window and /admin/profile over HTTP, with timeouts.

The I/O half of observing (observe.py holds the pure types and the rules of what is unknown).
"""
from __future__ import annotations

import asyncio
from typing import Sequence

import httpx

from stallfree.contracts import Profile, WindowStats
from stallfree.operator.control.observe import NOT_READY, ReplicaObservation, ReplicaTarget, classify


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
