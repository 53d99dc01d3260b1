"""Graceful drain: on SIGTERM readiness turns false, new requests get 503, in-flight ones finish, then exit.

Kubernetes sends SIGTERM and keeps routing for a moment; closing the listener at once (uvicorn's default)
would turn those late requests into connection errors. So the first SIGTERM (or SIGINT) only starts the
drain: the server keeps answering (503 + Retry-After for new work, /ready false), waits for the in-flight
requests up to the grace period, aborts what is left, and only then lets uvicorn shut down. A second
signal exits at once.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable, Callable

import uvicorn

from stallfree.http_doors.draining_server import DrainOnSignalServer

log = logging.getLogger("stallfree.server")


class DrainState:
    """In-flight requests and the draining flag; lives on the HTTP event loop (no lock needed)."""

    def __init__(self, grace_s: float = 30.0) -> None:
        self.grace_s = grace_s
        self.draining = False
        self.in_flight: set[str] = set()
        self._idle = asyncio.Event()
        self._idle.set()
        self.drain_started: float | None = None

    def enter(self, request_id: str) -> None:
        self.in_flight.add(request_id)
        self._idle.clear()

    def leave(self, request_id: str) -> None:
        self.in_flight.discard(request_id)
        if not self.in_flight:
            self._idle.set()

    def begin(self) -> None:
        if not self.draining:
            self.draining = True
            self.drain_started = time.monotonic()

    def remaining_s(self) -> float:
        if self.drain_started is None:
            return self.grace_s
        return max(0.0, self.grace_s - (time.monotonic() - self.drain_started))

    async def wait_idle(self, timeout_s: float) -> bool:
        """True when every in-flight request finished within the timeout."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout=max(0.0, timeout_s))
            return True
        except asyncio.TimeoutError:
            return not self.in_flight


async def drain(state: DrainState, abort: Callable[[str], Awaitable[None]]) -> int:
    """Refuse new work, let in-flight requests finish within the grace period, abort the rest.

    Returns how many requests had to be aborted."""
    state.begin()
    log.info("draining: %d request(s) in flight, grace %.1fs", len(state.in_flight), state.grace_s)
    if await state.wait_idle(state.remaining_s()):
        return 0
    left = list(state.in_flight)
    log.warning("drain grace period over: aborting %d request(s)", len(left))
    for request_id in left:
        await abort(request_id)
    # Give the aborted streams a moment to send their last event and close.
    await state.wait_idle(2.0)
    return len(left)


class DrainingServer(DrainOnSignalServer):
    """uvicorn.Server whose first SIGTERM/SIGINT drains (the grace period, then aborts) before shutting down."""

    log = log

    def __init__(self, config: uvicorn.Config, state: DrainState,
                 abort: Callable[[str], Awaitable[None]], companions: list[uvicorn.Server] = ()) -> None:
        super().__init__(config, companions)
        self.drain_state = state
        self._abort = abort
        self.aborted_on_drain = 0

    async def drain(self) -> None:
        self.aborted_on_drain = await drain(self.drain_state, self._abort)
