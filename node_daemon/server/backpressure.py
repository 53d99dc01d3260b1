"""Backpressure: a bounded queue in front of the engine, refused with 429 and Retry-After when full.

The queue is what the server accepted that has not produced its first token yet (waiting in the engine
or still prefilling): counted in requests and in prompt tokens. Beyond either bound a new request is
refused at once rather than left to time out. The server owns this count on its own event loop, so it
needs no lock and no round trip to the engine thread.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Refusal:
    status: int
    message: str
    retry_after_s: int
    code: str


@dataclass(slots=True)
class QueueTicket:
    num_prompt_tokens: int
    queued: bool = True


class AdmissionControl:
    def __init__(self, max_queue_requests: int = 0, max_queue_tokens: int = 0,
                 prefill_tokens_per_s: Callable[[], float] | None = None) -> None:
        """0 means no bound. `prefill_tokens_per_s` (the measured drain rate) sizes Retry-After."""
        if max_queue_requests < 0 or max_queue_tokens < 0:
            raise ValueError("queue bounds must be >= 0 (0 = unbounded)")
        self.max_queue_requests = max_queue_requests
        self.max_queue_tokens = max_queue_tokens
        self._prefill_rate = prefill_tokens_per_s
        self.queued_requests = 0
        self.queued_tokens = 0

    def try_admit(self, num_prompt_tokens: int) -> QueueTicket | Refusal:
        full = None
        if self.max_queue_requests and self.queued_requests + 1 > self.max_queue_requests:
            full = f"{self.queued_requests} requests already queued (limit {self.max_queue_requests})"
        # An empty queue always takes one request, however long its prompt: it could never be served otherwise.
        elif (self.max_queue_tokens and self.queued_requests
              and self.queued_tokens + num_prompt_tokens > self.max_queue_tokens):
            full = (f"{self.queued_tokens} prompt tokens already queued; {num_prompt_tokens} more exceed the "
                    f"limit {self.max_queue_tokens}")
        if full is not None:
            return Refusal(429, f"server overloaded: {full}; retry later", self.retry_after_s(), "queue_full")
        self.queued_requests += 1
        self.queued_tokens += num_prompt_tokens
        return QueueTicket(num_prompt_tokens)

    def dequeue(self, ticket: QueueTicket) -> None:
        """The request produced its first token (or ended): it no longer waits. Idempotent."""
        if ticket.queued:
            ticket.queued = False
            self.queued_requests -= 1
            self.queued_tokens -= ticket.num_prompt_tokens

    def retry_after_s(self) -> int:
        """Seconds until the queued prompt tokens are likely prefilled, from the measured prefill rate."""
        rate = self._prefill_rate() if self._prefill_rate else 0.0
        if rate <= 0:
            return 1
        return max(1, min(60, math.ceil(self.queued_tokens / rate)))
