"""Connection limits uvicorn lacks: a deadline for a request's headers, and a cap on open connections.

uvicorn closes idle keep-alive connections, but a client that sends part of its headers (slowloris) and
stops holds its connection forever, and any number of them may be open. `limited_h11_protocol` returns
uvicorn's h11 protocol with:
- a header deadline, armed when a connection opens and after each response, cleared when a request's
  headers are complete: past it the connection gets 408 (if it sent anything) and is closed;
- a cap on concurrent connections. Probes still answer past it: a kubelet that cannot reach /health restarts
  a daemon that is only busy, and every request in flight on it is lost. So up to PROBE_SLOTS connections
  over the cap are kept for one request each (its headers within PROBE_HEADER_TIMEOUT_S): GET /health and
  /ready are served, then the connection closes; anything else gets 503 with Retry-After. Past the reserve
  a connection gets 503 and is closed at once. Every request's scope says whether the cap is reached
  (CONNECTIONS_FULL): /ready then answers 503 "connections full", /health stays 200.
The body's own deadline is body_guard.py's (the ASGI app reads the body).
"""
from __future__ import annotations

import asyncio
import json

from starlette.types import Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from stallfree.http_doors.body_limit import drain
from stallfree.http_doors.error_json import error_body

PROBE_PATHS = frozenset({"/health", "/ready"})
PROBE_SLOTS = 16  # connections over the cap that may still ask for a probe
PROBE_HEADER_TIMEOUT_S = 2.0  # an over-cap connection's request must arrive within this (a probe sends it at once)
# The scope key: True when a new connection now would be over the cap (the request may itself be over it).
CONNECTIONS_FULL = "stallfree.connections_full"
# A refused over-cap request's body is read and dropped up to this, so the client can read the 503.
_OVER_CAP_DRAIN_BYTES, _OVER_CAP_DRAIN_S = 1 << 20, 2.0


def _raw_response(status: int, phrase: str, message: str, code: str, extra: str = "") -> bytes:
    body = json.dumps(error_body(status, message, code=code)).encode()
    head = (f"HTTP/1.1 {status} {phrase}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            f"{extra}connection: close\r\n\r\n")
    return head.encode("ascii") + body


def limited_h11_protocol(header_timeout_s: float, max_connections: int, on_refused=None) -> type[H11Protocol]:
    """An H11Protocol class for uvicorn.Config(http=...); `on_refused(reason)` counts refusals."""
    too_slow = _raw_response(408, "Request Timeout", f"the request headers did not arrive within "
                             f"{header_timeout_s:g} s", "request_timeout")
    message = f"this server holds its maximum of {max_connections} connections: retry shortly"
    too_many = _raw_response(503, "Service Unavailable", message, "too_many_connections", "retry-after: 1\r\n")
    too_many_body = json.dumps(error_body(503, message, code="too_many_connections")).encode()
    over_cap: set = set()  # this server's connections past the cap (each kept for one probe)

    def refuse(reason: str) -> None:
        if on_refused is not None:
            on_refused(reason)

    class LimitedH11Protocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None
        _bytes_since_response = False
        _seen_cycle = None
        _over_cap = False

        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if self._regular_connections() > max_connections:
                if len(over_cap) >= PROBE_SLOTS:
                    refuse("too_many_connections")
                    self.connections.discard(self)  # counted no more, even before connection_lost runs
                    transport.write(too_many)
                    transport.close()
                    return
                self._over_cap = True
                over_cap.add(self)
            self._app, self.app = self.app, self._gated_app
            self._arm_header_timer()

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_header_timer()
            over_cap.discard(self)
            super().connection_lost(exc)

        def _regular_connections(self) -> int:
            return len(self.connections) - len(over_cap)

        async def _gated_app(self, scope: Scope, receive: Receive, send: Send) -> None:
            scope[CONNECTIONS_FULL] = self._over_cap or self._regular_connections() >= max_connections
            if not self._over_cap:
                await self._app(scope, receive, send)
            elif scope["method"] in ("GET", "HEAD") and scope["path"] in PROBE_PATHS:
                await self._app(scope, receive, _closing(send))
            else:
                refuse("too_many_connections")
                await drain(receive, 0, _OVER_CAP_DRAIN_BYTES, _OVER_CAP_DRAIN_S)
                await send({"type": "http.response.start", "status": 503, "headers": [
                    (b"content-type", b"application/json"), (b"content-length", str(len(too_many_body)).encode()),
                    (b"retry-after", b"1"), (b"connection", b"close")]})
                await send({"type": "http.response.body", "body": too_many_body})

        def data_received(self, data: bytes) -> None:
            self._bytes_since_response = True
            super().data_received(data)

        def handle_events(self) -> None:
            super().handle_events()
            cycle = self.cycle
            if cycle is not None and cycle is not self._seen_cycle:
                self._seen_cycle = cycle  # a new request's headers are complete
                self._cancel_header_timer()

        def on_response_complete(self) -> None:
            self._bytes_since_response = False
            if not self.transport.is_closing():
                self._arm_header_timer()  # the next request's headers (super may start it at once)
            super().on_response_complete()

        def _arm_header_timer(self) -> None:
            self._cancel_header_timer()
            timeout_s = min(header_timeout_s, PROBE_HEADER_TIMEOUT_S) if self._over_cap else header_timeout_s
            self._header_timer = self.loop.call_later(timeout_s, self._headers_too_slow)

        def _cancel_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_too_slow(self) -> None:
            self._header_timer = None
            if self.transport.is_closing():
                return
            if self._bytes_since_response:
                refuse("timeout")
                self.transport.write(too_slow)
            self.transport.close()

    return LimitedH11Protocol


def _closing(send: Send) -> Send:
    """send, with Connection: close on the response (an over-cap connection serves one probe)."""

    async def closing(message) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", []), (b"connection", b"close")]}
        await send(message)

    return closing
