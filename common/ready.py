"""The one wait-until-ready loop: for a daemon, a replica set or a router a caller has just started.

`ready()` is polled until it holds or the deadline passes; `alive()` turning false means what we wait for has
exited, so waiting longer cannot help and the caller hears it at once instead of at the deadline.
`answers_ready` is the usual `ready()`: the daemon's (or router's) GET /ready answers 200.
"""
from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable

import httpx

__all__ = ["ExitedBeforeReady", "NotReadyInTime", "answers_ready", "answers_ready_async", "wait_until_ready",
           "wait_until_ready_async"]


class ExitedBeforeReady(RuntimeError):
    """What we waited for exited before it was ready."""


class NotReadyInTime(TimeoutError):
    """The deadline passed and `ready()` never held."""


def answers_ready(url: str, timeout_s: float = 1.0, client: httpx.Client | None = None) -> bool:
    """GET {url}/ready answered 200; any connection error or other status is not ready."""
    try:
        response = (client or httpx).get(f"{url}/ready", timeout=timeout_s)
    except httpx.HTTPError:
        return False
    return response.status_code == 200


async def answers_ready_async(client: httpx.AsyncClient, url: str, timeout_s: float = 1.0) -> bool:
    try:
        response = await client.get(f"{url}/ready", timeout=timeout_s)
    except httpx.HTTPError:
        return False
    return response.status_code == 200


def _always() -> bool:
    return True


def wait_until_ready(ready: Callable[[], bool], timeout_s: float, *, alive: Callable[[], bool] = _always,
                     poll_s: float = 0.5, what: str = "the daemon",
                     on_wait: Callable[[float], None] | None = None) -> None:
    """Block until `ready()`; raise ExitedBeforeReady when `alive()` turns false, NotReadyInTime after `timeout_s`.
    `on_wait(seconds waited)` is called between polls (a progress line); `what` names the thing in the errors."""
    _check(timeout_s, poll_s)
    started = time.monotonic()
    while True:
        if not alive():
            raise ExitedBeforeReady(f"{what} exited before it was ready")
        if ready():
            return
        waited = time.monotonic() - started
        if waited >= timeout_s:
            raise NotReadyInTime(f"{what} not ready after {timeout_s:.0f}s")
        if on_wait is not None:
            on_wait(waited)
        time.sleep(min(poll_s, timeout_s - waited))


async def wait_until_ready_async(ready: Callable[[], bool | Awaitable[bool]], timeout_s: float, *,
                                 alive: Callable[[], bool] = _always, poll_s: float = 0.5, what: str = "the daemon",
                                 on_wait: Callable[[float], None] | None = None) -> None:
    """wait_until_ready in an event loop: `ready()` may be a plain predicate or a coroutine function."""
    _check(timeout_s, poll_s)
    started = time.monotonic()
    while True:
        if not alive():
            raise ExitedBeforeReady(f"{what} exited before it was ready")
        answer = ready()
        if inspect.isawaitable(answer):
            answer = await answer
        if answer:
            return
        waited = time.monotonic() - started
        if waited >= timeout_s:
            raise NotReadyInTime(f"{what} not ready after {timeout_s:.0f}s")
        if on_wait is not None:
            on_wait(waited)
        await asyncio.sleep(min(poll_s, timeout_s - waited))


def _check(timeout_s: float, poll_s: float) -> None:
    if not timeout_s >= 0 or not poll_s > 0:
        raise ValueError(f"timeout_s must be >= 0 and poll_s > 0, got timeout_s={timeout_s}, poll_s={poll_s}")
