"""Connection limits uvicorn lacks: a deadline for a request's headers, and a cap on open connections.

uvicorn closes idle keep-alive connections, but a client that sends part of its headers (slowloris) and
stops holds its connection forever, and any number of them may be open. `limited_h11_protocol` returns
uvicorn's h11 protocol with:
- a header deadline, armed when a connection opens and after each response, cleared when a request's
  headers are complete: past it the connection gets 408 (if it sent anything) and is closed;
- a cap on concurrent connections: one over the cap gets 503 with Retry-After and is closed at once.
The body's own deadline is body_guard.py's (the ASGI app reads the body).
"""
from __future__ import annotations

import asyncio
import json

from uvicorn.protocols.http.h11_impl import H11Protocol

from stallfree.node_daemon.server.errors import error_body

def _raw_response(status: int, phrase: str, message: str, code: str, extra: str = "") -> bytes:
    body = json.dumps(error_body(status, message, code=code)).encode()
    head = (f"HTTP/1.1 {status} {phrase}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            f"{extra}connection: close\r\n\r\n")
    return head.encode("ascii") + body


def limited_h11_protocol(header_timeout_s: float, max_connections: int, on_refused=None) -> type[H11Protocol]:
    """An H11Protocol class for uvicorn.Config(http=...); `on_refused(reason)` counts refusals."""
    too_slow = _raw_response(408, "Request Timeout", f"the request headers did not arrive within "
                             f"{header_timeout_s:g} s", "request_timeout")
    too_many = _raw_response(503, "Service Unavailable", f"this server holds its maximum of {max_connections} "
                             "connections: retry shortly", "too_many_connections", "retry-after: 1\r\n")

    class LimitedH11Protocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None
        _bytes_since_response = False
        _seen_cycle = None

        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if len(self.connections) > max_connections:
                if on_refused is not None:
                    on_refused("too_many_connections")
                transport.write(too_many)
                transport.close()
                return
            self._arm_header_timer()

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_header_timer()
            super().connection_lost(exc)

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
            self._header_timer = self.loop.call_later(header_timeout_s, self._headers_too_slow)

        def _cancel_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_too_slow(self) -> None:
            self._header_timer = None
            if self.transport.is_closing():
                return
            if self._bytes_since_response:
                if on_refused is not None:
                    on_refused("timeout")
                self.transport.write(too_slow)
            self.transport.close()

    return LimitedH11Protocol
