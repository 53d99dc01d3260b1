"""A uvicorn server whose first SIGTERM (or SIGINT) drains before it shuts down; a second signal exits at once.

Kubernetes keeps routing to a pod for a moment after SIGTERM, and uvicorn's own handling closes the listener at
once, cutting every open stream with no last event. The daemon and the router both start their drain here; each
says what draining means by overriding `drain()`.
"""
from __future__ import annotations

import asyncio
import logging
import signal
from types import FrameType
from typing import Sequence

import uvicorn


class DrainOnSignalServer(uvicorn.Server):
    log = logging.getLogger("stallfree")

    def __init__(self, config: uvicorn.Config, companions: Sequence[uvicorn.Server] = ()) -> None:
        super().__init__(config)
        # Servers on the same loop (the daemon's probe listener): they start with this one and stop after it, so
        # liveness keeps answering through the drain.
        self.companions = list(companions)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task | None = None

    async def drain(self) -> None:
        """What the first signal starts; the server shuts down when it returns."""
        raise NotImplementedError

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
            # A second signal (or not serving yet): uvicorn's own fast path.
            self.force_exit = self._drain_task is not None or self.force_exit
            self.should_exit = True
            return
        # Not recorded in _captured_signals: a completed drain is a clean exit, not a re-raised signal.
        self.log.info("received %s: draining", signal.Signals(sig).name)
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        if self._drain_task is None:
            self._drain_task = asyncio.ensure_future(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        try:
            await self.drain()
        finally:
            self.should_exit = True
