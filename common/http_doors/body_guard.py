"""Every request body read whole before any route sees it: within a deadline, and as JSON a client cannot abuse.

Plain ASGI middleware (inside BodyLimitMiddleware, so the size cap applies while reading):
- the body must arrive within `body_timeout_s` of the headers, else 408 and the connection closes (a client
  that sends half a body and stops holds nothing for long);
- a body that looks like JSON is checked by json_checks.check_json (bounded before it is parsed, then depth,
  lone surrogates, non-finite numbers, 64-bit integers): each refusal a 400 in OpenAI's error shape, on every
  route (admin ones included), with one log line at most.
Large bodies (and any whose structure must be counted string by string) are checked on a worker thread so
the event loop keeps serving streams. The parsed body is left in the scope (PARSED_BODY) for the
route, so nothing parses it again on the event loop; the body itself is replayed to the app unchanged.
"""
from __future__ import annotations

import asyncio
import json
import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from stallfree.http_doors.body_limit import BodyTooLarge
from stallfree.http_doors.error_json import error_body
from stallfree.http_doors.json_bounds import within_bounds_at_a_glance
from stallfree.http_doors.json_checks import NOT_JSON, BodyRefused, check_json

# The scope key under which a route finds the parsed body.
PARSED_BODY = "stallfree.parsed_body"
RAW_BODY = "stallfree.raw_body"  # the body's bytes as received (what a signed header's digest is checked against)
OFF_LOOP_BYTES = 256 << 10  # bodies larger than this are parsed on a worker thread


class BodyGuardMiddleware:
    def __init__(self, app: ASGIApp, body_timeout_s: float, on_refused=None) -> None:
        self.app = app
        self.body_timeout_s = body_timeout_s
        self._on_refused = on_refused  # called with the metrics reason of each refusal

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        try:
            body = await self._read_body(receive)
        except BodyTooLarge as exc:
            await self._refuse(send, 413, str(exc.detail), "request_too_large", "too_large")
            return
        except TimeoutError:
            await self._refuse(send, 408, f"the request body did not arrive within {self.body_timeout_s:g} s",
                               "request_timeout", "timeout")
            return
        except _Disconnected:
            return
        if body.lstrip()[:1] in (b"{", b"["):
            try:
                if len(body) > OFF_LOOP_BYTES or not within_bounds_at_a_glance(body):
                    parsed = await asyncio.to_thread(check_json, body)
                else:
                    parsed = check_json(body)
            except BodyRefused as exc:
                await self._refuse(send, 400, str(exc), exc.code, "invalid_request")
                return
            if parsed is not NOT_JSON:
                scope[PARSED_BODY] = parsed
        scope[RAW_BODY] = body
        await self.app(scope, _replay(body, receive), send)

    async def _read_body(self, receive: Receive) -> bytes:
        deadline = time.monotonic() + self.body_timeout_s
        parts: list[bytes] = []
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError
            message = await asyncio.wait_for(receive(), remaining)
            if message["type"] == "http.disconnect":
                raise _Disconnected
            parts.append(message.get("body", b""))
            if not message.get("more_body", False):
                return b"".join(parts)

    async def _refuse(self, send: Send, status: int, message: str, code: str, reason: str) -> None:
        if self._on_refused is not None:
            self._on_refused(reason)
        body = json.dumps(error_body(status, message, code=code)).encode()
        # Connection: close: a body that came too slowly was never read whole, so the connection cannot be reused.
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})


class _Disconnected(Exception):
    """The client left before its body was complete: nothing to answer."""


def _replay(body: bytes, receive: Receive) -> Receive:
    """The whole body as one message, then the real receive (the app still learns of a disconnect)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
