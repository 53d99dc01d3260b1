"""A request-body size limit as plain ASGI middleware: 413 with OpenAI error JSON before anything parses it.

Checks Content-Length up front and counts the bytes of chunked bodies as they arrive, so a client cannot
make the server buffer more than `max_bytes` either way.
"""
from __future__ import annotations

import json

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from stallfree.node_daemon.server.errors import error_body


class BodyTooLarge(HTTPException):
    """Raised from receive() mid-body; FastAPI passes HTTPExceptions through to the error handlers."""

    def __init__(self, max_bytes: int) -> None:
        super().__init__(413, f"request body exceeds the limit of {max_bytes} bytes")


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, max_bytes: int, on_refused=None) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self._on_refused = on_refused  # called with no argument when a body is refused (metrics)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        for name, value in scope["headers"]:
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = -1
                if declared > self.max_bytes:
                    await self._refuse(send)
                    return
                break

        received = 0

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
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
