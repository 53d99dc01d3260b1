"""One admitted request's life on the HTTP side: admission, in-flight tracking, and abort when the caller leaves.

Whatever way a request ends (finished, client disconnected, stream cancelled, server error) `close()` runs
exactly once: the queue ticket is returned, the drain stops waiting for it and, unless the engine already
finished it, the engine is told to abort it so its KV blocks are freed at the next iteration.
"""
from __future__ import annotations

import asyncio
from typing import AsyncIterator

from stallfree.node_daemon.engine.engine_protocol import RequestOutput
from stallfree.node_daemon.engine.sampling_params import SamplingParams
from stallfree.node_daemon.server.app import Daemon
from stallfree.node_daemon.server.backpressure import QueueTicket, Refusal
from stallfree.node_daemon.server.errors import APIError


def admit(daemon: Daemon, num_prompt_tokens: int) -> QueueTicket:
    """A queue ticket, or APIError 503 (draining) / 429 (queue full), both with Retry-After."""
    daemon.stats.on_arrival(num_prompt_tokens)
    if daemon.drain.draining:
        raise APIError(503, "server is draining (shutting down): send the request to another replica",
                       code="draining", reason="draining", headers={"Retry-After": "1"})
    verdict = daemon.admission.try_admit(num_prompt_tokens)
    if isinstance(verdict, Refusal):
        raise APIError(verdict.status, verdict.message, code=verdict.code, reason="queue_full",
                       headers={"Retry-After": str(verdict.retry_after_s)})
    return verdict


ROUTER_QUEUE_HEADER = "x-stallfree-router-queue-ms"
MAX_ROUTER_WAIT_S = 600.0  # a header is a client's word: bounded, it can only shift one request's own timings


def router_wait_s(headers) -> float:
    """Seconds the request waited in the router's queue (its header), 0 when absent or malformed."""
    try:
        value = float(headers.get(ROUTER_QUEUE_HEADER, "0")) / 1000.0
    except ValueError:
        return 0.0
    return min(MAX_ROUTER_WAIT_S, value) if value > 0 else 0.0  # NaN and negatives: 0


class Generation:
    def __init__(self, daemon: Daemon, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams,
                 ticket: QueueTicket, waited_s: float = 0.0) -> None:
        self.daemon = daemon
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.sampling = sampling
        self.ticket = ticket
        self.waited_s = waited_s  # in the router's queue, before it came here
        self.finished = False
        self._closed = False
        daemon.drain.enter(request_id)

    async def outputs(self) -> AsyncIterator[RequestOutput]:
        """The engine's outputs for this request; closes the generation when iteration stops for any reason."""
        try:
            async for out in self.daemon.engine.generate(self.request_id, self.prompt_token_ids, self.sampling,
                                                      self.waited_s):
                if self.ticket.queued and (out.num_output_tokens or out.finished):
                    self.daemon.admission.dequeue(self.ticket)
                if out.finished:
                    self.finished = True
                yield out
                if self.finished:
                    return
        finally:
            self.close()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        daemon = self.daemon
        daemon.admission.dequeue(self.ticket)
        daemon.drain.leave(self.request_id)
        if not self.finished:
            # Runs from finally blocks of cancelled tasks too: schedule the abort instead of awaiting it.
            task = asyncio.get_running_loop().create_task(daemon.engine.abort(self.request_id))
            daemon.background.add(task)
            task.add_done_callback(daemon.background.discard)
