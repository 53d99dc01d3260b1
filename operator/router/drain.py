"""SIGTERM drains the router: /ready and new requests 503 at once, open requests finish, then it exits.

Kubernetes keeps sending a pod requests for a moment after SIGTERM, and closing the listener at once (uvicorn's
way) cuts every stream with no last event. So the first SIGTERM (or SIGINT) only starts the drain
(proxy.Router.drain): the Service learns from /ready, new requests are refused with Retry-After, those in
flight get `drain_timeout_s` to finish (the pod's grace period covers it), and a stream still open then ends
with an error event and `[DONE]`. A second signal exits at once.
"""
from __future__ import annotations

import asyncio
import logging
import signal
from types import FrameType
from typing import TYPE_CHECKING

import uvicorn

if TYPE_CHECKING:
    from stallfree.operator.router.proxy import Router

log = logging.getLogger("stallfree.router")


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, router: Router, drain_timeout_s: float) -> None:
        super().__init__(config)
        self.router = router
        self.drain_timeout_s = drain_timeout_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task | None = None

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._loop is None or self.should_exit or self._drain_task is not None:
            self.force_exit = self._drain_task is not None or self.force_exit  # a second signal: now
            self.should_exit = True
            return
        log.info("received %s: draining", signal.Signals(sig).name)
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        if self._drain_task is None:
            self._drain_task = asyncio.ensure_future(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        try:
            await self.router.drain(self.drain_timeout_s)
        finally:
            self.should_exit = True
