"""What the router sends back to a client: a whole answer, a refusal in OpenAI's error shape, an SSE error event."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import AsyncIterator, Awaitable, Callable

from starlette.types import Send

from stallfree.http_doors.error_json import error_body


@dataclass
class Answer:
    """What goes back to the client: a whole body, or `chunks` relayed as they arrive."""
    status: int
    headers: list[tuple[bytes, bytes]]
    body: bytes = b""
    chunks: AsyncIterator[bytes] | None = None
    replica: str | None = None
    close: Callable[[], Awaitable[None]] | None = None  # frees the upstream side (idempotent)


def refusal_answer(status: int, message: str, code: str, param: str | None = None,
                   retry_after_s: int = 1) -> Answer:
    body = json.dumps(error_body(status, message, param=param, code=code)).encode()
    headers = [(b"content-type", b"application/json")]
    if status in (429, 503):
        headers.append((b"retry-after", str(retry_after_s).encode()))
    return Answer(status, headers, body)


def sse_error(message: str, code: str) -> bytes:
    return f"data: {json.dumps(error_body(500, message, code=code))}\n\n".encode()


async def respond(send: Send, answer: Answer) -> None:
    headers = [*answer.headers, (b"content-length", str(len(answer.body)).encode())]
    await send({"type": "http.response.start", "status": answer.status, "headers": headers})
    await send({"type": "http.response.body", "body": answer.body})
