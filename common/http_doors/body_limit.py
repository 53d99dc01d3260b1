"""A request-body size limit as plain ASGI middleware: 413 with OpenAI error JSON before anything parses it.

Checks Content-Length up front and counts the bytes of chunked bodies as they arrive, so a client cannot
make the server buffer more than `max_bytes` either way.

Before the 413 the rest of the body is read and dropped (up to DRAIN_MAX_BYTES, within the body deadline):
a server that closes with unread bytes in its socket makes the kernel reset the connection, and a client that
writes its whole body before reading (httpx's AsyncClient, so the openai client) then sees a dropped
connection, not the 413, and retries the same upload. A client that asked `Expect: 100-continue` has sent no
body yet: it gets the 413 at once.
"""
from __future__ import annotations

import asyncio
import json
import time

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from stallfree.http_doors.error_json import error_body

# A refused body is read and dropped up to this many bytes; past it the connection is closed unread. Dropped bytes
# cost no memory, and a 100 MB upload (a client's "send the whole file" mistake) still gets its 413 read.
DRAIN_MAX_BYTES = 256 << 20


class BodyTooLarge(HTTPException):
    """Raised from receive() mid-body; FastAPI passes HTTPExceptions through to the error handlers."""

    def __init__(self, max_bytes: int) -> None:
        super().__init__(413, f"request body exceeds the limit of {max_bytes} bytes")


async def drain(receive: Receive, received: int, max_bytes: int, timeout_s: float) -> bool:
    """Read and drop the rest of a body, `received` bytes of it already read; True once it has all arrived,
    False past `max_bytes` in all, past `timeout_s`, or when the client left."""
    deadline = time.monotonic() + timeout_s
    while received <= max_bytes:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        try:
            message = await asyncio.wait_for(receive(), remaining)
        except TimeoutError:
            return False
        if message["type"] != "http.request":
            return False
        received += len(message.get("body", b""))
        if not message.get("more_body", False):
            return True
    return False


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, max_bytes: int, on_refused=None, drain_timeout_s: float = 30.0) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.drain_timeout_s = drain_timeout_s
        self._on_refused = on_refused  # called with no argument when a body is refused (metrics)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        declared, expects_continue = _declared_length(scope["headers"])
        if declared > self.max_bytes:
            # Nothing was sent yet (100-continue) or the body is past what is worth reading: answer unread.
            if not expects_continue and declared <= DRAIN_MAX_BYTES:
                await drain(receive, 0, DRAIN_MAX_BYTES, self.drain_timeout_s)
            await self._refuse(send)
            return

        received = 0

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    if message.get("more_body", False):
                        await drain(receive, received, DRAIN_MAX_BYTES, self.drain_timeout_s)
                    raise BodyTooLarge(self.max_bytes)
            return message

        await self.app(scope, counting_receive, send)

    async def _refuse(self, send: Send) -> None:
        if self._on_refused is not None:
            self._on_refused()
        body = json.dumps(error_body(413, f"request body exceeds the limit of {self.max_bytes} bytes",
                                     code="request_too_large")).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})


def _declared_length(headers) -> tuple[int, bool]:
    """(Content-Length, or -1 when absent or unreadable; whether the client waits for 100 Continue)."""
    declared, expects_continue = -1, False
    for name, value in headers:
        if name == b"content-length":
            try:
                declared = int(value)
            except ValueError:
                declared = -1
        elif name == b"expect" and value.lower() == b"100-continue":
            expects_continue = True
    return declared, expects_continue
