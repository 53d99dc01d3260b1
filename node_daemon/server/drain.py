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
import signal
import time
from types import FrameType
from typing import Awaitable, Callable

import uvicorn

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


class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose first SIGTERM/SIGINT drains before shutting down."""

    def __init__(self, config: uvicorn.Config, state: DrainState,
                 abort: Callable[[str], Awaitable[None]], companions: list[uvicorn.Server] = ()) -> None:
        super().__init__(config)
        # Servers on the same loop (the probe listener): they start with this one and stop after it, so
        # liveness keeps answering through the drain.
        self.companions = list(companions)
        self.drain_state = state
        self._abort = abort
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task | None = None
        self.aborted_on_drain = 0

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        tasks = [asyncio.ensure_future(c.serve()) for c in self.companions]
        try:
            await super().serve(sockets)
        finally:
            for companion in self.companions:
                companion.should_exit = True
            await asyncio.gather(*tasks, return_exceptions=True)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._loop is None or self.should_exit or self._drain_task is not None:
            # Second signal (or not serving yet): uvicorn's own fast path.
            self.force_exit = self._drain_task is not None or self.force_exit
            self.should_exit = True
            return
        # Not recorded in _captured_signals: a completed drain is a clean exit, not a re-raised signal.
        log.info("received %s: draining", signal.Signals(sig).name)
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        if self._drain_task is None:
            self._drain_task = asyncio.ensure_future(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        try:
            self.aborted_on_drain = await drain(self.drain_state, self._abort)
        finally:
            self.should_exit = True
