"""SIGTERM drains the router: /ready and new requests 503 at once, open requests finish, then it exits.

Kubernetes keeps sending a pod requests for a moment after SIGTERM, and closing the listener at once (uvicorn's
way) cuts every stream with no last event. So the first SIGTERM (or SIGINT) only starts the drain
(proxy.Router.drain): the Service learns from /ready, new requests are refused with Retry-After, those in
flight get `drain_timeout_s` to finish (the pod's grace period covers it), and a stream still open then ends
with an error event and `[DONE]`. A second signal exits at once.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import uvicorn

from stallfree.http_doors.draining_server import DrainOnSignalServer

if TYPE_CHECKING:
    from stallfree.operator.router.proxy import Router

log = logging.getLogger("stallfree.router")


class DrainingServer(DrainOnSignalServer):
    log = log

    def __init__(self, config: uvicorn.Config, router: Router, drain_timeout_s: float,
                 companions: list[uvicorn.Server] = ()) -> None:
        super().__init__(config, companions)
        self.router = router
        self.drain_timeout_s = drain_timeout_s

    async def drain(self) -> None:
        await self.router.drain(self.drain_timeout_s)
