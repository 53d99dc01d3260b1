"""A request's objective as the router signed it (stallfree.request_objective_header), made the engine's.

The scheduler orders by priority and deadline, so only the router's word counts: an objective header without the
router's signature (sent by a client straight to the daemon, forged, stale, or signed with another admin token),
or one signed for another request (another id or body) or seen before (a replay: each nonce counts once), is
ignored, counted, and logged the first time; the request is served as one without an objective (priority 0,
no deadline: first come, first served). The router's deadline is on the wall clock; the engine's clock is
time.monotonic, so it is carried over once, here.
"""
from __future__ import annotations

import logging
import time

from stallfree.node_daemon.engine.request import Objective
from stallfree.request_objective_header import OBJECTIVE_HEADER, NonceBook, read

log = logging.getLogger(__name__)


class RouterObjective:
    def __init__(self) -> None:
        self.ignored = 0
        self.nonces = NonceBook()

    def of(self, headers, admin_token: str | None, body: bytes, server: tuple[str, int] | None,
           now_s: float | None = None, now_monotonic: float | None = None) -> Objective | None:
        """The engine's Objective of a request with these headers and this body, arrived on the listener `server`
        (the ASGI scope's), or None (no objective, or not the router's for this request)."""
        if OBJECTIVE_HEADER not in headers:
            return None
        now_s = time.time() if now_s is None else now_s
        signed = read(headers, admin_token, now_s, body, server, self.nonces)
        if signed is None:
            if not self.ignored:
                log.warning("ignoring %s without the router's signature for this request (sent by a client, "
                            "replayed, or the admin tokens of router and daemon differ); further ones are counted "
                            "only", OBJECTIVE_HEADER)
            self.ignored += 1
            return None
        deadline = None
        if signed.deadline_s is not None:
            now_monotonic = time.monotonic() if now_monotonic is None else now_monotonic
            deadline = now_monotonic + (signed.deadline_s - now_s)
        return Objective(signed.name, signed.priority, deadline, signed.tpot_ms)


router_objective = RouterObjective()
