"""What the router sends back to a client: a whole answer, a refusal in OpenAI's error shape, an SSE error event."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import AsyncIterator, Awaitable, Callable

from starlette.types import Send

from stallfree.http_doors.error_json import error_body
from stallfree.operator.router.shedding import SHED_CODE


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


def shed_answer(objective: str, predicted_ms: float, target_ms: float, backlog_drain_ms: float = 0.0) -> Answer:
    """The 429 for a request of a sheddable objective predicted to miss its TTFT target at every replica. Retry
    after the backlog there is now has drained (shedding.backlog_drain_ms, 1-60 s): the prediction itself may rest
    on higher bands' arrivals still to come, or on rates not known yet, and says nothing of when a retry fares
    better."""
    retry_s = max(1, min(60, math.ceil(backlog_drain_ms / 1000.0)))
    predicted = f"{predicted_ms:.0f} ms" if predicted_ms < 3.6e6 else "over an hour: the higher priorities take it all"
    return refusal_answer(429, f"objective `{objective}` is sheddable and its predicted time to first token "
                          f"({predicted}) misses its target ({target_ms:g} ms) at every replica; retry "
                          "later", SHED_CODE, retry_after_s=retry_s)


def queue_full_answer(max_queued: int, share: int | None, backlog_drain_ms: float = 0.0) -> Answer:
    """The 429 for a request the router's queue has no room for: the whole queue, or its flow's `share` of it.
    Retry after the queue there is now has drained (1-60 s)."""
    retry_s = max(1, min(60, math.ceil(backlog_drain_ms / 1000.0)))
    if share is not None:
        return refusal_answer(429, f"this tenant's share of the router's queue is full ({share} of {max_queued} "
                              "requests, shared by the tenants and objectives sending lately); retry later",
                              "queue_full", retry_after_s=retry_s)
    return refusal_answer(429, f"the router's queue is full ({max_queued} requests waiting); retry later",
                          "queue_full", retry_after_s=retry_s)


def sse_error(message: str, code: str) -> bytes:
    return f"data: {json.dumps(error_body(500, message, code=code))}\n\n".encode()


async def respond(send: Send, answer: Answer) -> None:
    headers = [*answer.headers, (b"content-length", str(len(answer.body)).encode())]
    await send({"type": "http.response.start", "status": answer.status, "headers": headers})
    await send({"type": "http.response.body", "body": answer.body})
