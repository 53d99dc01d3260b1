"""One admitted request's life on the HTTP side, its n choices included: admission, in-flight tracking, abort.

n > 1 runs one engine request per choice, the prompt's KV computed once: choice 0 starts alone and the others
start when it reports its first token, i.e. once its whole prompt is in the KV cache and its full blocks are in
the prefix cache, so their prefills compute only the prompt's last, partial block. Seeded choices use
seed + index (as vLLM), so two seeded choices differ and each is reproducible. The request holds one queue
ticket (choice 0's).

Whatever way a request ends (finished, client disconnected, stream cancelled, server error) `close()` runs
exactly once: the queue ticket is returned, the drain stops waiting for it and every choice the engine has not
finished is aborted so its KV blocks are freed at the next iteration.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from typing import TYPE_CHECKING, AsyncIterator

from stallfree.node_daemon.engine.engine_protocol import RequestOutput
from stallfree.node_daemon.engine.sampling_params import SamplingParams
from stallfree.node_daemon.server.app import Daemon
from stallfree.node_daemon.server.backpressure import QueueTicket, Refusal
from stallfree.node_daemon.server.errors import APIError
from stallfree.router_queue_header import QUEUE_HEADER, SIGNATURE_HEADER, verify

if TYPE_CHECKING:
    from stallfree.node_daemon.engine.request import Objective
    from stallfree.node_daemon.structured.compiler import CompiledGrammar

log = logging.getLogger(__name__)


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


# Outputs per choice an n > 1 request's merged queue holds before its choices wait for the caller to read.
CHOICES_BACKLOG = 4
MAX_ROUTER_WAIT_S = 600.0  # even the router's word is bounded: it can only shift one request's own timings


class RouterWait:
    """The seconds a request waited in the router's queue, believed only when the router signed them with the admin
    token (stallfree.router_queue_header); any other queue header is ignored, counted, and logged the first time."""

    def __init__(self) -> None:
        self.ignored = 0

    def seconds(self, headers, admin_token: str | None, now_s: float | None = None) -> float:
        raw = headers.get(QUEUE_HEADER)
        if raw is None:
            return 0.0
        now_s = time.time() if now_s is None else now_s
        if not verify(raw, headers.get(SIGNATURE_HEADER), admin_token, now_s):
            if not self.ignored:
                log.warning("ignoring %s without the router's signature (sent by a client, or the admin tokens of "
                            "router and daemon differ); further ones are counted only", QUEUE_HEADER)
            self.ignored += 1
            return 0.0
        try:
            value = float(raw) / 1000.0
        except ValueError:
            return 0.0
        return min(MAX_ROUTER_WAIT_S, value) if value > 0 else 0.0  # NaN and negatives: 0


router_wait = RouterWait()


_SEED_MODULUS = 1 << 64


class Generation:
    def __init__(self, daemon: Daemon, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams,
                 ticket: QueueTicket, waited_s: float = 0.0, n: int = 1,
                 grammar: CompiledGrammar | None = None, objective: Objective | None = None) -> None:
        self.daemon = daemon
        self.grammar = grammar  # each choice's engine request gets a matcher of its own
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.sampling = sampling
        self.n = n
        self.samplings = [sampling if i == 0 or sampling.seed is None
                          else dataclasses.replace(sampling, seed=(sampling.seed + i) % _SEED_MODULUS)
                          for i in range(n)]
        # One choice keeps the request's id in the engine; choices of n > 1 are "<id>-<index>".
        self.engine_ids = [request_id] if n == 1 else [f"{request_id}-{i}" for i in range(n)]
        self.ticket = ticket
        self.waited_s = waited_s  # in the router's queue, before it came here
        self.objective = objective  # the router's, signed (router_objective.py): every choice gets it
        self._started = [False] * n
        self._finished = [False] * n
        self._closed = False
        self._pumps: list[asyncio.Future] = []  # n > 1: the tasks that read each choice's stream
        self._start(0)

    def _start(self, index: int) -> None:
        self._started[index] = True
        self.daemon.drain.enter(self.engine_ids[index])

    async def _choice(self, index: int) -> AsyncIterator[RequestOutput]:
        engine_id = self.engine_ids[index]
        # checked=True: openai_routes checked the request against the engine's limits before admission.
        extra = {"grammar": self.grammar} if self.grammar is not None else {}
        if self.objective is not None:
            extra["objective"] = self.objective
        # aclosing: a consumer that stops early closes the engine's stream at once (its `finally` frees the stream's
        # place), not whenever the collector reaches a generator caught in a cycle with its exception.
        async with contextlib.aclosing(self.daemon.engine.generate(
                engine_id, self.prompt_token_ids, self.samplings[index], self.waited_s, checked=True,
                **extra)) as outputs:
            async for out in outputs:
                if index == 0 and self.ticket.queued and (out.num_output_tokens or out.finished):
                    self.daemon.admission.dequeue(self.ticket)
                if out.finished:
                    self._finished[index] = True
                yield out
                if out.finished:
                    return

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(choice index, output) as they come until every choice finished; closes the request on exit."""
        try:
            if self.n == 1:  # the common case: no queue between the engine's stream and the caller
                async with contextlib.aclosing(self._choice(0)) as choice:
                    async for out in choice:
                        yield 0, out
            else:
                async with contextlib.aclosing(self._all_choices()) as choices:  # its finally cancels the pumps
                    async for item in choices:
                        yield item
        finally:
            self.close()

    async def _all_choices(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        queue: asyncio.Queue = asyncio.Queue()
        done = object()
        # The caller read everything: a pump past its share of the queue waits for that, so a client that stops
        # reading leaves the backlog in each choice's own stream, where the engine pauses the choice.
        drained = asyncio.Event()
        bound = CHOICES_BACKLOG * self.n

        async def pump(index: int) -> None:
            try:
                # aclosing: cancelled while it waits for the caller (a paused choice), the pump still closes the
                # choice's stream; without it the stream stayed in flight (a drain waited on it) until collected.
                async with contextlib.aclosing(self._choice(index)) as choice:
                    async for out in choice:
                        queue.put_nowait((index, out))
                        while queue.qsize() >= bound:
                            drained.clear()
                            await drained.wait()
            except BaseException as exc:  # noqa: BLE001 - handed to the consumer, which raises it
                queue.put_nowait((index, exc))
            finally:
                queue.put_nowait((index, done))

        tasks = self._pumps
        tasks.append(asyncio.ensure_future(pump(0)))
        remaining = 1
        siblings_started = False
        try:
            while remaining:
                index, item = await queue.get()
                if queue.empty():
                    drained.set()
                if index == 0 and not siblings_started:
                    siblings_started = True
                    if item is not done and not isinstance(item, BaseException):
                        for i in range(1, self.n):
                            self._start(i)
                            tasks.append(asyncio.ensure_future(pump(i)))
                        remaining += self.n - 1
                if item is done:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield index, item
        finally:
            for task in tasks:
                task.cancel()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for pump in self._pumps:  # a stream dropped unread (its response cancelled) never ran their cancel
            pump.cancel()
        daemon = self.daemon
        daemon.admission.dequeue(self.ticket)
        for index, engine_id in enumerate(self.engine_ids):
            if not self._started[index]:
                continue
            daemon.drain.leave(engine_id)
            if not self._finished[index]:
                # Runs from finally blocks of cancelled tasks too: schedule the abort instead of awaiting it.
                task = asyncio.get_running_loop().create_task(daemon.engine.abort(engine_id))
                daemon.background.add(task)
                task.add_done_callback(daemon.background.discard)
