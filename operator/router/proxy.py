"""The router's forwarding: each OpenAI request to the replica the policy picks, and its answer back.

A request is held until its replica's first body byte arrives; until then nothing has reached the
client, so a replica that refuses (503: draining, starting), cannot be reached (killed) or goes unhealthy
(hung) is left and the request is sent once more to another one. After the first byte the stream is the
client's: bytes pass through as they arrive; an upstream that fails, or stays silent past the stall
timeout, ends the stream with an error event and `[DONE]`, and so does a drain that runs out of time.

From the moment its body is read until its answer is sent, a request watches its client: a client that
leaves, queued, waiting for a non-streamed answer or streaming, cancels it here, which closes the upstream
connection (the replica aborts the request and frees its KV blocks).

Generation requests (POST) first wait in the router's waiting room (waiting_room.py: its rules, clock-free,
which the simulator runs too) until a replica can start them soon; the time they waited there goes to the
replica in `x-stallfree-router-queue-ms`, signed with the admin token (stallfree.router_queue_header), so its
queue wait and TTFT count from the router's arrival. Only requests the router accepted (admission.py) count as
demand. Each request names its objective and tenant in headers (objectives.py): they decide its place in the
queue and, for a sheddable objective predicted to miss everywhere, a 429 at arrival; the replica gets the
objective as the waiting room signs it (stallfree.request_objective_header), for its scheduler's order. This
file keeps the HTTP side: the wait for a dispatch, the forwarding, retries, the relay and the drain. Which paths
come here, and the body's bounds, are the edge's (edge.py).
"""
from __future__ import annotations

import asyncio
import logging
import random
import secrets
import time
from dataclasses import dataclass, field, replace
from typing import AsyncIterator

import anyio
import httpx
from starlette.types import Receive, Scope, Send

from stallfree.http_doors.body_guard import OFF_LOOP_BYTES, PARSED_BODY
from stallfree.http_doors.json_checks import NOT_JSON
from stallfree.operator.router import admission
from stallfree.operator.router.edge import create_app  # noqa: F401 - callers build the app from here
from stallfree.operator.router.answers import (Answer, queue_full_answer, refusal_answer, respond, shed_answer,
                                               sse_error)
from stallfree.operator.router.client_io import client_left, whole_body
from stallfree.operator.router.affinity import DEFAULT_BLOCK_TOKENS, PrefixTable, prefix_hashes
from stallfree.operator.router.api_keys import KeyBook
from stallfree.operator.router.flow_control import FlowConfig, Queued
from stallfree.operator.router.forwarding import NoCookies, is_admin, response_headers, upstream_headers
from stallfree.operator.router.identity import Unauthorized, identify, objective_for
from stallfree.operator.router.metrics import RouterMetrics
from stallfree.operator.router.objectives import OBJECTIVE_HEADER, Objective, Objectives, header
from stallfree.operator.router.pick import AffinityMargin, Choice, ReplicaView, pick, rendezvous_home
from stallfree.operator.router.replicas import Replica, ReplicaPool
from stallfree.operator.router.requests import RequestInfo, read_parsed
from stallfree.operator.router.shedding import SHED_CODE
from stallfree.operator.router.waiting_room import QueueFull, Shed, WaitingRoom, client_error
from stallfree.request_objective_header import REQUEST_ID_HEADER, bind, body_digest
from stallfree.request_objective_header import headers as objective_headers
from stallfree.router_queue_header import QUEUE_HEADER, SIGNATURE_HEADER, sign

log = logging.getLogger("stallfree.router")

# Statuses that mean "this replica, not this request": worth one more try elsewhere.
RETRY_STATUSES = frozenset({502, 503, 504})
# A request that failed before its first byte (nothing reached the client) is sent again, each time elsewhere.
MAX_ATTEMPTS = 3
REPLICA_HEADER = "x-stallfree-replica"  # which replica answered: for a request with the admin token only
_CUT_GRACE_S = 2.0  # after a drain's timeout, how long cut streams get to send their last event


class RetryElsewhere(Exception):
    """This replica failed before the first byte; the request may go to another."""

    def __init__(self, reason: str, response: httpx.Response | None = None, body: bytes = b"",
                 retry: bool = True) -> None:
        super().__init__(reason)
        self.reason = reason
        self.response = response  # a refusal to pass on if no other replica is left
        self.body = body
        self.retry = retry  # False: this request may be what stalled the replica; sent nowhere else


@dataclass
class RouterConfig:
    policy: str = "slo-aware"
    chars_per_token: float = 4.0
    block_tokens: int = DEFAULT_BLOCK_TOKENS
    margin: AffinityMargin = AffinityMargin()
    connect_timeout_s: float = 1.0
    seed: int = 0
    flow: FlowConfig = FlowConfig()
    flow_control: bool = True  # False: every request goes to a replica at once (the router before its queue)
    queue_timeout_s: float = 60.0  # a request waiting longer than this in the queue is answered 503
    no_replica_wait_s: float = 5.0  # with no replica healthy this long, a queued request is answered 503 at once
    dispatch_tick_s: float = 0.05  # queue re-checked this often (stats polls, slots freed), besides events
    # A stream whose replica sends nothing for this long ends with an error event (a hung replica holds it no longer).
    stream_stall_timeout_s: float = 30.0
    # The classes of requests (--objectives); the implicit one keeps the queue first come, first served.
    objectives: Objectives = field(default_factory=Objectives.implicit)
    # Who a request is (identity.py): API keys (None: anonymous serving, one tenant) and the trusted gateway's secret.
    api_keys: KeyBook | None = None
    upstream_secret: str | None = None


class Router:
    def __init__(self, pool: ReplicaPool, config: RouterConfig, metrics: RouterMetrics | None = None) -> None:
        self.pool = pool
        self.config = config
        self.metrics = metrics or RouterMetrics()
        self.prefixes = PrefixTable(config.block_tokens)
        self.block_chars = max(1, round(config.block_tokens * config.chars_per_token))
        self.counter = 0
        self.rng = random.Random(config.seed)
        self.client: httpx.AsyncClient | None = None
        self.room: WaitingRoom[int] = WaitingRoom(config.flow, config.objectives)  # the rules (waiting_room.py)
        self.queue = self.room.queue
        self._waiters: dict[int, tuple[asyncio.Future, RequestInfo, list[int], int]] = {}
        self._next_key = 0
        self._ticker: asyncio.Task | None = None
        self._last_healthy_at = time.perf_counter()  # when some replica was last seen healthy
        # Done once no replica has been healthy for no_replica_wait_s: every queued request wakes on it, so none
        # polls (thousands waiting woke 4 times a second each, and the loop had no time left to refuse).
        self._none_ready: asyncio.Future | None = None
        pool._on_change = self._replica_changed
        self.admin_token = getattr(pool, "admin_token", None)
        self.draining = False  # set by drain(): /ready 503, new requests 503
        self.in_flight = 0  # requests between their body and their last byte
        self._idle = asyncio.Event()
        self._idle.set()
        self._cut = asyncio.Event()  # set when a drain runs out of time: open streams end now

    async def start(self) -> None:
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(None, connect=self.config.connect_timeout_s),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=256))
        self.client._cookies = NoCookies()  # httpx has no switch for it: see forwarding.NoCookies
        await self.pool.start()
        self._ticker = asyncio.ensure_future(self._tick())

    def use_objectives(self, objectives: Objectives) -> None:
        """The objectives each new request is judged by (queued ones keep the band and deadline they got)."""
        self.config.objectives = self.room.objectives = objectives

    async def close(self) -> None:
        if self._ticker is not None:
            self._ticker.cancel()
            await asyncio.gather(self._ticker, return_exceptions=True)
        await self.pool.close()
        if self.client is not None:
            await self.client.aclose()

    def _replica_changed(self, replica: Replica) -> None:
        if replica.removed or replica.reason == "loading model":
            self.prefixes.forget(replica.name)  # a new process: its prefix cache starts empty
        healthy = self.pool.healthy()
        self.metrics.replicas_healthy.set(len(healthy))
        self.metrics.replicas_known.set(len(self.pool.replicas))
        self.metrics.replica_healthy.labels(replica.name).set(1 if replica.healthy and not replica.removed else 0)
        self.dispatch()  # a replica that became ready takes from the queue at once

    # -- flow control -----------------------------------------------------------------------------
    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(self.config.dispatch_tick_s)
            if self.pool.healthy():
                self._last_healthy_at = time.perf_counter()
            elif self._none_ready_for_long() and self._none_ready is not None and not self._none_ready.done():
                self._none_ready.set_result(None)
            if len(self.queue):
                self.dispatch()

    def _none_ready_future(self) -> asyncio.Future:
        """The future every queued request waits on beside its own dispatch (see _none_ready)."""
        if self._none_ready is None or (self._none_ready.done() and not self._none_ready_for_long()):
            self._none_ready = asyncio.get_running_loop().create_future()
        return self._none_ready

    def _none_ready_for_long(self) -> bool:
        return not self.pool.healthy() and time.perf_counter() - self._last_healthy_at >= self.config.no_replica_wait_s

    def dispatch(self) -> None:
        """Hand waiting requests, oldest first, to replicas that can start them soon (flow_control.py)."""
        if not len(self.queue):
            return
        healthy = self.pool.healthy()
        if not healthy:
            return
        self._last_healthy_at = time.perf_counter()
        names = [r.name for r in healthy]
        for r in healthy:  # the table forgets what each replica's own KV cache cannot hold
            if r.stats is not None:
                self.prefixes.set_capacity(r.name, r.stats.kv_capacity_tokens)

        def choose(item: Queued[int], candidates: list[ReplicaView]) -> Choice:
            _, info, hashes, seq = self._waiters[item.key]
            return self._pick(info, hashes, candidates, names, seq)

        now = time.perf_counter()
        for item, choice in self.room.dispatch([r.view(now) for r in healthy], choose, now):
            future, info, hashes, _ = self._waiters.pop(item.key)
            replica = self.pool.replicas[choice.name]
            ticket = self._reserve(replica, info.prompt_tokens, now, item.sent_priority, item.tenant, info.sequences,
                                   self.room.objectives.by_name.get(item.objective), item.arrival_s)
            self.metrics.queue_wait.observe(now - item.arrival_s)
            self.metrics.objective_queue_wait.labels(item.objective).observe(now - item.arrival_s)
            if item.seq > 0:  # a retry (pushed to the front) was counted on its first dispatch
                self.metrics.objective_requests.labels(item.objective, "dispatched").inc()
            if not future.done():
                future.set_result((replica, choice, hashes, ticket))
            else:  # its client left in the same turn: give the reservation back
                self._unreserve(replica, ticket)
        self._queue_gauges()

    def queue_status(self) -> dict:
        return self.room.status(time.perf_counter())

    def _queue_gauges(self) -> None:
        self.metrics.queue_depth.set(len(self.queue))
        self.metrics.queue_prompt_tokens.set(self.queue.queued_prompt_tokens)
        depths = self.queue.depth_by_objective()
        for name in self.config.objectives.by_name:
            self.metrics.objective_queue_depth.labels(name).set(depths.get(name, 0))

    async def _wait_in_queue(self, info: RequestInfo, received: float, seq: int, exclude: frozenset[str],
                             front: bool, objective: Objective,
                             tenant: str) -> tuple[Replica, Choice, list[int], int] | Answer:
        """Queue the request and wait for its dispatch or the queue timeout; cancelled when its client leaves."""
        key = self._next_key = self._next_key + 1
        def views() -> list[ReplicaView]:
            now = time.perf_counter()
            return [r.view(now) for r in self.pool.healthy()]

        item = self.room.arrive(key, objective, tenant, info.prompt_tokens, received, views,
                                self.pool.starting_in_ms(time.monotonic()), exclude, front, info.sequences)
        if isinstance(item, Shed):
            self.metrics.objective_requests.labels(objective.name, "shed").inc()
            self.metrics.refused.labels(SHED_CODE).inc()
            return shed_answer(objective.name, item.predicted_ms, objective.ttft_ms or 0.0, item.backlog_drain_ms)
        if isinstance(item, QueueFull):
            self.metrics.queue_rejected.inc()
            self.metrics.objective_requests.labels(objective.name, "queue_full").inc()
            return queue_full_answer(self.config.flow.max_queued, item.share, item.backlog_drain_ms)
        if not front:
            self.metrics.arrivals.inc()
        hashes = prefix_hashes(info.prompt_text, self.block_chars) if self.config.policy == "slo-aware" else []
        future: asyncio.Future = asyncio.get_running_loop().create_future()
        self._waiters[key] = (future, info, hashes, seq)
        self.dispatch()
        if future.done():
            return future.result()
        self._queue_gauges()
        outcome = "dispatched"
        try:
            while not future.done():
                now = time.perf_counter()
                if now - received >= self.config.queue_timeout_s:
                    outcome = "timeout"
                    break
                if self._none_ready_for_long():
                    outcome = "no_replica"  # every replica down for a while: say so rather than hold the client
                    break
                await asyncio.wait((future, self._none_ready_future()),
                                   timeout=self.config.queue_timeout_s - (now - received),
                                   return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:  # the client left
            self._waiters.pop(key, None)
            if future.done() and not future.cancelled():
                replica, _, _, ticket = future.result()  # dispatched in the same turn: give the reservation back
                self._unreserve(replica, ticket)
            else:
                future.cancel()
                self.queue.cancel(key)
                self.metrics.queue_cancelled.inc()
                self.metrics.objective_requests.labels(objective.name, "cancelled").inc()
            self._queue_gauges()
            raise
        if future.done() and not future.cancelled():
            return future.result()
        future.cancel()
        self._waiters.pop(key, None)
        if self.queue.cancel(key):
            self.queue.cancelled -= 1  # not a client leaving
        self._queue_gauges()
        self.metrics.objective_requests.labels(objective.name, outcome).inc()
        self.room.unserved(objective)
        if outcome == "no_replica":
            self.metrics.unroutable.inc()
            return refusal_answer(503, "no replica is ready to take requests; retry shortly", "no_ready_replica")
        self.metrics.queue_timeouts.inc()
        return refusal_answer(503, f"no replica could start the request within {self.config.queue_timeout_s:g}s "
                              "in the router's queue", "queue_timeout")

    def _reserve(self, replica: Replica, tokens: int, now_s: float, priority: int = 0, tenant: str = "",
                 sequences: int = 1, objective: Objective | None = None, arrival_s: float | None = None) -> int:
        """Counted at dispatch, before any await (waiting_room.reserve): the next dispatch sees it."""
        self.metrics.in_flight.inc()
        return self.room.reserve(replica, tokens, now_s, priority, tenant, objective, arrival_s, sequences)

    def _unreserve(self, replica: Replica, ticket: int) -> None:
        self.room.release(replica, ticket, time.perf_counter())
        self.metrics.in_flight.dec()

    # -- the pick ---------------------------------------------------------------------------------
    def _pick(self, info: RequestInfo, hashes: list[int], candidates: list[ReplicaView], names: list[str],
              seq: int) -> Choice:
        """The policy's choice among `candidates`; slo-aware adds prefix affinity (homes over all `names`)."""
        if self.config.policy == "slo-aware" and hashes:
            home = rendezvous_home(hashes[0], names)
            candidates = [replace(v, cached_prefix_tokens=self.prefixes.cached_tokens(v.name, hashes),
                                  home=v.name == home) for v in candidates]
        return pick(self.config.policy, candidates, info.prompt_tokens, seq, self.rng, self.config.margin)

    def choose(self, info: RequestInfo, exclude: set[str], seq: int, objective: Objective | None = None,
               arrival_s: float | None = None) -> tuple[Replica, Choice, list[int], int] | None:
        """An immediate pick (requests that do not queue: GETs), among the healthy replicas not excluded; a
        generation request's `objective` judges its first byte."""
        healthy = [r for r in self.pool.healthy() if r.name not in exclude]
        if not healthy:
            return None
        hashes = prefix_hashes(info.prompt_text, self.block_chars) if self.config.policy == "slo-aware" else []
        now = time.perf_counter()
        choice = self._pick(info, hashes, [r.view(now) for r in healthy], [r.name for r in healthy], seq)
        replica = self.pool.replicas[choice.name]
        return replica, choice, hashes, self._reserve(replica, info.prompt_tokens, now, sequences=info.sequences,
                                                      objective=objective,
                                                      arrival_s=arrival_s)

    # -- one request ------------------------------------------------------------------------------
    async def serve(self, scope: Scope, receive: Receive, send: Send, upstream_path: str) -> None:
        """One OpenAI request, its path already routed (paths.py) and its body bounded (edge.py)."""
        received = time.perf_counter()
        method = scope["method"]
        if self.draining:
            await respond(send, refusal_answer(503, "the router is shutting down; retry on another",
                                                "draining"))
            return
        body = await whole_body(receive) if method in ("POST", "PUT", "PATCH") else b""
        caller = identify(scope["headers"], self.config.api_keys, self.admin_token, self.config.upstream_secret,
                          time.monotonic())
        if isinstance(caller, Unauthorized):
            self.metrics.refused.labels(caller.code).inc()
            await respond(send, refusal_answer(caller.status, caller.message, caller.code))
            return
        info = RequestInfo(False, "", 0)
        objective = self.config.objectives.default
        if method == "POST":
            parsed = scope.get(PARSED_BODY, NOT_JSON)
            served = admission.served_models(self.pool.healthy())
            refused = admission.refusal(parsed, served)
            if refused is not None:
                self.metrics.refused.labels(refused.code).inc()
                await respond(send, refusal_answer(refused.status, refused.message, refused.code, refused.param))
                return
            asked = header(scope["headers"], OBJECTIVE_HEADER)
            named = admission.objective_or_refusal(asked, self.config.objectives)
            if isinstance(named, admission.Refusal):
                self.metrics.refused.labels(named.code).inc()
                await respond(send, refusal_answer(named.status, named.message, named.code, named.param))
                return
            allowed = objective_for(caller, named, bool(asked and asked.strip()), self.config.objectives)
            if isinstance(allowed, Unauthorized):
                self.metrics.refused.labels(allowed.code).inc()
                await respond(send, refusal_answer(allowed.status, allowed.message, allowed.code, "objective"))
                return
            objective = allowed
            info = admission.bounded(read_parsed(parsed, self.config.chars_per_token), parsed["model"], served)
        headers = upstream_headers(scope["headers"], scope.get("client"), scope.get("scheme", "http"))
        admin = is_admin(scope["headers"], self.admin_token)
        self._enter()
        left = asyncio.ensure_future(client_left(receive))
        work = asyncio.ensure_future(self._answer(method, upstream_path, headers, body, info, received, objective,
                                                  caller.tenant))
        cut = asyncio.ensure_future(self._cut.wait())
        answer: Answer | None = None
        try:
            await asyncio.wait((work, left, cut), return_when=asyncio.FIRST_COMPLETED)
            if not work.done():  # the client left, or the drain ran out of time, before the answer
                work.cancel()
                await asyncio.gather(work, return_exceptions=True)
                if left.done():
                    self.metrics.client_left.labels("before_answer").inc()
                else:
                    await respond(send, refusal_answer(503, "the router is shutting down; retry on another",
                                                        "draining"))
                return
            try:
                answer = work.result()
            except Exception:  # a bug: the trace goes to the log, never to the client
                log.exception("unhandled error on %s %s", method, upstream_path)
                answer = refusal_answer(500, "internal router error", "internal_error")
            if admin and answer.replica is not None:
                answer.headers.append((REPLICA_HEADER.encode(), answer.replica.encode("latin-1")))
            if answer.chunks is None:
                await respond(send, answer)
            elif not await self._stream(send, answer, left):
                self.metrics.client_left.labels("streaming").inc()
        finally:
            left.cancel()
            cut.cancel()
            work.cancel()  # a no-op once it is done; else this handler itself was cancelled (shutdown)
            if answer is not None and answer.close is not None:
                await answer.close()
            self._leave()

    async def _answer(self, method: str, path: str, headers: list[tuple[str, str]], body: bytes, info: RequestInfo,
                      received: float, objective: Objective, tenant: str) -> Answer:
        tried: set[str] = set()
        last_refusal: RetryElsewhere | None = None
        queued = method == "POST" and self.config.flow_control
        self.counter += 1  # once per request: a retry must not shift round-robin's order
        seq = self.counter
        # The body's digest, for a signed objective; before any reservation (nothing to give back if cancelled).
        digest = await _digest(body) if method == "POST" and self.admin_token else None
        for attempt in range(MAX_ATTEMPTS):
            if queued:
                picked = await self._wait_in_queue(info, received, seq, frozenset(tried), attempt > 0, objective,
                                                   tenant)
                if isinstance(picked, Answer):
                    return picked
            else:
                picked = self.choose(info, tried, seq, objective if method == "POST" else None, received)
                if picked is None:
                    break
            replica, choice, hashes, ticket = picked
            tried.add(replica.name)
            if attempt:
                self.metrics.retries.labels(last_refusal.reason if last_refusal else "unknown").inc()
            self.metrics.picks.labels(replica.name, self.config.policy, choice.reason).inc()
            if choice.predicted_ttft_ms is not None:
                self.metrics.predicted_ttft.labels(self.config.policy).observe(choice.predicted_ttft_ms / 1000)
            if hashes:
                self.prefixes.record(replica.name, hashes, info.prompt_tokens)
            waited_ms = (time.perf_counter() - received) * 1000.0
            leg_headers = headers + _queue_headers(f"{waited_ms:.1f}", self.admin_token) if queued else headers
            if method == "POST":  # the priority it was sent with, and its deadline from the router's arrival
                sent = replica.held.get(ticket, objective.priority) if queued else objective.priority
                signed = self.room.signed(objective, sent, time.time() - waited_ms / 1000.0)
                if signed is not None and digest is not None:  # bound to this request: id, body, replica, nonce
                    binding = bind(f"router-{seq}-{secrets.token_hex(6)}", digest, replica.url)
                    leg_headers = [h for h in leg_headers if h[0] != REQUEST_ID_HEADER] + objective_headers(
                        signed, self.admin_token, time.time(), binding)
            try:
                return await self._send(replica, choice, ticket, method, path, leg_headers, body, info, received,
                                        objective)
            except RetryElsewhere as exc:
                last_refusal = exc
                if not exc.retry:
                    log.warning("not retrying %s: %s on %s", path, exc.reason, replica.name)
                    break
                log.info("retrying %s elsewhere: %s on %s", path, exc.reason, replica.name)
        if method == "POST":
            self.room.unserved(objective)
        if last_refusal is not None and last_refusal.response is not None:
            refused = last_refusal.response
            return Answer(refused.status_code, response_headers(refused.headers.multi_items()), last_refusal.body)
        self.metrics.unroutable.inc()
        if last_refusal is not None:
            return refusal_answer(503, f"no replica could take the request (last: {last_refusal.reason})",
                                  "no_ready_replica")
        return refusal_answer(503, "no replica is ready to take requests; retry shortly", "no_ready_replica")

    async def _send(self, replica: Replica, choice: Choice, ticket: int, method: str, path: str, headers,
                    body: bytes, info: RequestInfo, received: float, objective: Objective) -> Answer:
        assert self.client is not None
        state = {"open": True}  # reserved on the replica at dispatch (_reserve)

        def release() -> None:
            if state["open"]:
                state["open"] = False
                self._unreserve(replica, ticket)
                self.dispatch()  # a running slot is free

        try:
            upstream = self.client.build_request(method, replica.url + path, headers=headers, content=body)
            replica.last_sent = ticket
            response, first = await self._first_byte(replica, upstream, ticket)
        except BaseException:  # _first_byte closed what it opened
            release()
            raise
        now = time.perf_counter()
        generation = method == "POST"  # what its objective's TTFT target is about
        self.room.first_byte(replica, ticket, now, response.status_code)
        self.dispatch()  # its prefill is done: the replica may take the next one
        if generation and client_error(response.status_code):
            self.room.refused_by_replica(info.prompt_tokens)  # junk (a 4xx): no demand
        elapsed = now - received
        self.metrics.observed_ttft.labels(self.config.policy).observe(elapsed)
        if generation:
            self.metrics.objective_ttft.labels(objective.name).observe(elapsed)
            if objective.ttft_ms is not None and elapsed * 1000.0 > objective.ttft_ms:
                self.metrics.objective_ttft_missed.labels(objective.name).inc()
        if choice.predicted_ttft_ms is not None:
            self.metrics.ttft_error.labels(self.config.policy).observe(abs(elapsed - choice.predicted_ttft_ms / 1000))
        out_headers = response_headers(response.headers.multi_items())

        async def close() -> None:
            release()
            await _close(response)

        iterator = response.extensions.get("router_iterator")
        if not info.stream or response.status_code != 200 or \
                not response.headers.get("content-type", "").startswith("text/event-stream"):
            try:
                rest = [chunk async for chunk in iterator] if iterator is not None else []
            except httpx.HTTPError as exc:
                raise RetryElsewhere(f"{type(exc).__name__} reading the body") from None
            finally:
                await close()
            return Answer(response.status_code, out_headers, b"".join([first or b"", *rest]), replica=replica.name)
        return Answer(response.status_code, out_headers, chunks=self._relay(replica, iterator, first),
                      replica=replica.name, close=close)

    async def _first_byte(self, replica: Replica, upstream: httpx.Request,
                          ticket: int = 0) -> tuple[httpx.Response, bytes | None]:
        """Send and wait for the first body chunk, or give up as soon as the replica turns unhealthy. A replica
        that stopped answering (its polls time out) while this request was the newest sent there may have been
        stalled by it (a request the daemon chokes on): it is not sent to another, which it could stall too."""
        assert self.client is not None
        down = replica.down_event
        if down.is_set():
            raise RetryElsewhere("replica went unhealthy")
        holder: dict[str, httpx.Response] = {}

        async def first() -> bytes | None:
            response = await self.client.send(upstream, stream=True)
            holder["response"] = response
            if response.status_code in RETRY_STATUSES:
                body = await response.aread()
                raise RetryElsewhere(f"HTTP {response.status_code}", response, body)
            holder["iterator"] = response.aiter_raw()
            try:
                return await holder["iterator"].__anext__()
            except StopAsyncIteration:
                return None

        async def abandon() -> None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            if "response" in holder:
                await _close(holder["response"])

        task = asyncio.ensure_future(first())
        waiter = asyncio.ensure_future(down.wait())
        try:
            await asyncio.wait((task, waiter), return_when=asyncio.FIRST_COMPLETED)
        except BaseException:  # cancelled: the client left while the replica prefilled or generated
            waiter.cancel()
            await abandon()
            raise
        waiter.cancel()
        if not task.done():
            await abandon()
            if ticket and replica.last_sent == ticket and "Timeout" in replica.reason:
                raise RetryElsewhere("the replica stopped answering right after this request reached it",
                                     retry=False)
            raise RetryElsewhere("replica went unhealthy")
        try:
            chunk = task.result()
        except RetryElsewhere:
            raise
        except (httpx.HTTPError, OSError) as exc:
            if "response" in holder:
                await _close(holder["response"])
            raise RetryElsewhere(type(exc).__name__) from None
        response = holder["response"]
        response.extensions["router_iterator"] = holder.get("iterator")
        return response, chunk

    async def _relay(self, replica: Replica, iterator: AsyncIterator[bytes] | None,
                     first: bytes | None) -> AsyncIterator[bytes]:
        """The stream's bytes as they arrive; an error event and `[DONE]` when the replica fails, stays silent
        past the stall timeout, or a drain runs out of time. The caller closes the upstream (Answer.close)."""
        ended = True  # whether what went out so far ends with a whole SSE event
        if first:
            yield first
            ended = first.endswith(b"\n\n")
        if iterator is None:
            return
        stall_s = self.config.stream_stall_timeout_s
        cut = asyncio.ensure_future(self._cut.wait())  # one waiter for the whole stream
        try:
            while True:
                chunk_task = asyncio.ensure_future(iterator.__anext__())
                try:
                    await asyncio.wait((chunk_task, cut), timeout=stall_s, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    if not chunk_task.done():
                        chunk_task.cancel()
                        await asyncio.gather(chunk_task, return_exceptions=True)
                    elif not chunk_task.cancelled():
                        chunk_task.exception()  # read: it may have ended (StopAsyncIteration) as the client left
                if chunk_task.done() and not chunk_task.cancelled():
                    try:
                        chunk = chunk_task.result()
                    except StopAsyncIteration:
                        return
                    except (httpx.HTTPError, OSError) as exc:
                        message, code = (f"the replica serving this stream failed mid-stream "
                                         f"({type(exc).__name__}); the request did not complete", "upstream_failed")
                    else:
                        yield chunk
                        ended = chunk.endswith(b"\n\n")
                        continue
                elif cut.done():
                    message, code = "the router is shutting down and its drain timeout passed", "router_draining"
                else:
                    message, code = (f"the replica serving this stream sent nothing for {stall_s:g} s; the "
                                     "request did not complete", "upstream_stalled")
                self.metrics.stream_errors.labels(replica.name).inc()
                yield (b"" if ended else b"\n\n") + sse_error(message, code) + b"data: [DONE]\n\n"
                return
        finally:
            cut.cancel()

    async def _stream(self, send: Send, answer: Answer, left: asyncio.Future) -> bool:
        """Relay the chunks until they end or the client leaves; False when it left."""
        assert answer.chunks is not None
        chunks = answer.chunks

        async def pump() -> None:
            try:
                await send({"type": "http.response.start", "status": answer.status, "headers": answer.headers})
                async for chunk in chunks:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            finally:
                await chunks.aclose()

        task = asyncio.ensure_future(pump())
        try:
            await asyncio.wait((task, left), return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        if task.cancelled():
            return False
        if task.exception() is not None:  # the send failed: the client is gone
            return False
        return True

    # -- drain ------------------------------------------------------------------------------------
    def _enter(self) -> None:
        self.in_flight += 1
        self._idle.clear()

    def _leave(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self._idle.set()

    async def drain(self, timeout_s: float) -> int:
        """/ready and new requests 503 from now; wait up to `timeout_s` for those in flight, then end the open
        streams with an error event. Returns how many requests were still open at the timeout."""
        self.draining = True
        log.info("draining: %d request(s) in flight, timeout %.1fs", self.in_flight, timeout_s)
        try:
            await asyncio.wait_for(self._idle.wait(), timeout=max(0.0, timeout_s))
            return 0
        except asyncio.TimeoutError:
            pass
        left = self.in_flight
        log.warning("drain timeout over: ending %d request(s)", left)
        self._cut.set()
        try:
            await asyncio.wait_for(self._idle.wait(), timeout=_CUT_GRACE_S)
        except asyncio.TimeoutError:
            pass
        return left


async def _digest(body: bytes) -> str:
    """The body's SHA-256, off the event loop when it is large (hashlib drops the GIL)."""
    return await asyncio.to_thread(body_digest, body) if len(body) > OFF_LOOP_BYTES else body_digest(body)


def _queue_headers(waited_ms: str, admin_token: str | None) -> list[tuple[str, str]]:
    """The ms a request waited here, signed with the admin token: a daemon believes no one else (router_queue_header)."""
    signed = [(SIGNATURE_HEADER, sign(waited_ms, admin_token, time.time()))] if admin_token else []
    return [(QUEUE_HEADER, waited_ms), *signed]


async def _close(response: httpx.Response) -> None:
    # Shielded: on a client disconnect this runs inside a cancelled scope, and the upstream must still close.
    with anyio.CancelScope(shield=True):
        await response.aclose()

