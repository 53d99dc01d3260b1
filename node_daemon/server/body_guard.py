"""Every request body read whole before any route sees it: within a deadline, and as JSON a client cannot abuse.

Plain ASGI middleware (inside BodyLimitMiddleware, so the size cap applies while reading):
- the body must arrive within `body_timeout_s` of the headers, else 408 and the connection closes (a client
  that sends half a body and stops holds nothing for long);
- a body that parses as JSON must nest at most MAX_JSON_DEPTH deep, hold no lone UTF-16 surrogate in any
  string or key (`"\\ud800"` parses in Python but no tokenizer or client can encode it), no NaN or Infinity,
  no float that overflows to infinity, and no integer outside 64 bits. Each refusal is a 400 in OpenAI's
  error shape, on every route (admin ones included), with one log line at most.
Bodies that are not JSON pass through: the route gives its own 400 for them. The checked body is replayed to
the app unchanged; large bodies are checked on a worker thread so the event loop keeps serving streams.
"""
from __future__ import annotations

import asyncio
import json
import math
import time
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from stallfree.node_daemon.server.body_limit import BodyTooLarge
from stallfree.node_daemon.server.errors import error_body

MAX_JSON_DEPTH = 32
_INT_MIN, _INT_MAX = -(1 << 63), (1 << 64) - 1  # int64 or uint64: what JSON clients can represent
_OFF_LOOP_BYTES = 256 << 10  # bodies larger than this are parsed on a worker thread


class BodyRefused(ValueError):
    """The body is JSON a client must not send; `code` names why."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code


def _parse_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise BodyRefused(f"the number {text[:40]} is out of range (non-finite)", "invalid_number")
    return value


def _parse_int(text: str) -> int:
    if len(text) > 21:  # cheaper than converting a 4000-digit number first
        raise BodyRefused(f"the integer {text[:24]}... does not fit in 64 bits", "invalid_number")
    value = int(text)
    if not _INT_MIN <= value <= _INT_MAX:
        raise BodyRefused(f"the integer {text} does not fit in 64 bits", "invalid_number")
    return value


def _refuse_constant(name: str) -> Any:
    raise BodyRefused(f"{name} is not a valid JSON number", "invalid_number")


def _check_text(value: str) -> None:
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise BodyRefused("a string holds a lone UTF-16 surrogate (such as \\ud800): send valid Unicode",
                              "invalid_unicode") from None


def check_json(raw: bytes) -> None:
    """Raise BodyRefused for JSON a client must not send; return quietly for good JSON and for non-JSON."""
    try:
        parsed = json.loads(raw, parse_float=_parse_float, parse_int=_parse_int, parse_constant=_refuse_constant)
    except BodyRefused:
        raise
    except RecursionError:
        raise BodyRefused(f"the JSON body is nested too deeply (at most {MAX_JSON_DEPTH} levels)",
                          "invalid_json") from None
    except ValueError:
        return  # not JSON (or not UTF-8): the route answers that itself
    stack: list[tuple[Any, int]] = [(parsed, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, str):
            _check_text(value)
        elif isinstance(value, (list, dict)):
            if depth > MAX_JSON_DEPTH:
                raise BodyRefused(f"the JSON body is nested too deeply (at most {MAX_JSON_DEPTH} levels)",
                                  "invalid_json")
            if isinstance(value, dict):
                for key, item in value.items():
                    _check_text(key)
                    if isinstance(item, (str, list, dict)):
                        stack.append((item, depth + 1))
            else:
                stack.extend((item, depth + 1) for item in value if isinstance(item, (str, list, dict)))


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
                if len(body) > _OFF_LOOP_BYTES:
                    await asyncio.to_thread(check_json, body)
                else:
                    check_json(body)
            except BodyRefused as exc:
                await self._refuse(send, 400, str(exc), exc.code, "invalid_request")
                return
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
        # Connection: close: the rest of a refused body is never read, so the connection cannot be reused.
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
