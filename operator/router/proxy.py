"""The router's HTTP edge: every /v1/* request to the replica the policy picks, passed through unchanged.

A request is held until its replica's first body byte arrives; until then nothing has reached the
client, so a replica that refuses (503: draining, starting), cannot be reached (killed) or goes unhealthy
(hung) is left and the request is sent once more to another one. After the first byte the stream is the
client's: bytes pass through as they arrive, a client that leaves closes the upstream connection (the
replica aborts the request), and an upstream that fails mid-stream ends the stream with an error event.

Generation requests (POST) first wait in the router's queue (flow_control.py) until a replica can start
them soon; the time they waited there goes to the replica in `x-stallfree-router-queue-ms`, so its queue
wait and TTFT count from the router's arrival.
"""
from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from dataclasses import dataclass, replace

import anyio
import httpx
from fastapi import FastAPI
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from stallfree.operator.router.affinity import DEFAULT_BLOCK_TOKENS, PrefixTable, prefix_hashes
from stallfree.operator.router.flow_control import FlowConfig, FlowQueue, Queued
from stallfree.operator.router.metrics import RouterMetrics
from stallfree.operator.router.pick import AffinityMargin, Choice, ReplicaView, pick, rendezvous_home
from stallfree.operator.router.replicas import Replica, ReplicaPool
from stallfree.operator.router.requests import RequestInfo, read_request

log = logging.getLogger("stallfree.router")

# Statuses that mean "this replica, not this request": worth one more try elsewhere.
RETRY_STATUSES = frozenset({502, 503, 504})
# A request that failed before its first byte (nothing reached the client) is sent again, each time elsewhere.
MAX_ATTEMPTS = 3
QUEUE_HEADER = "x-stallfree-router-queue-ms"  # ms the request waited in the router's queue (daemons add it)
# Hop-by-hop and length headers are the router's own business on each leg.
_DROP_HEADERS = frozenset({"host", "x-stallfree-router-queue-ms", "content-length", "transfer-encoding", "connection", "keep-alive", "upgrade",
                           "te", "trailer", "proxy-authorization", "accept-encoding"})
_DROP_RESPONSE_HEADERS = frozenset({"content-length", "transfer-encoding", "connection", "keep-alive",
                                    "content-encoding", "date", "server"})


def error_json(status: int, message: str, code: str, kind: str = "service_unavailable_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": code}},
                        status_code=status, headers={"Retry-After": "1"} if status in (429, 503) else None)


def sse_error(message: str, code: str) -> bytes:
    body = {"error": {"message": message, "type": "server_error", "param": None, "code": code}}
    return f"data: {json.dumps(body)}\n\n".encode()


class RetryElsewhere(Exception):
    """This replica failed before the first byte; the request may go to another."""

    def __init__(self, reason: str, response: httpx.Response | None = None, body: bytes = b"") -> None:
        super().__init__(reason)
        self.reason = reason
        self.response = response  # a refusal to pass on if no other replica is left
        self.body = body


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
        self.queue: FlowQueue[int] = FlowQueue(config.flow)
        self._waiters: dict[int, tuple[asyncio.Future, RequestInfo, list[int], int]] = {}
        self._next_key = 0
        self._next_ticket = 0
        self.arrived_prompt_tokens = 0  # a counter: the control loop takes its rate between two reads
        self.arrived_prompt_tokens_sq = 0  # and of the squares: the spread of prompt lengths (queueing.py)
        self._ticker: asyncio.Task | None = None
        self._last_healthy_at = time.perf_counter()  # when some replica was last seen healthy
        pool._on_change = self._replica_changed

    async def start(self) -> None:
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(None, connect=self.config.connect_timeout_s),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=256))
        await self.pool.start()
        self._ticker = asyncio.ensure_future(self._tick())

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
            if len(self.queue):
                self.dispatch()

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
        for item, choice in self.queue.dispatch([r.view(now) for r in healthy], choose):
            future, info, hashes, _ = self._waiters.pop(item.key)
            replica = self.pool.replicas[choice.name]
            ticket = self._reserve(replica, info.prompt_tokens, now)
            self.metrics.queue_wait.observe(now - item.arrival_s)
            if not future.done():
                future.set_result((replica, choice, hashes, ticket))
            else:  # its client left in the same turn: give the reservation back
                self._unreserve(replica, ticket)
        self._queue_gauges()

    def queue_status(self) -> dict:
        now = time.perf_counter()
        oldest = self.queue.oldest_arrival_s()
        return {"depth": len(self.queue), "queued_prompt_tokens": self.queue.queued_prompt_tokens,
                "oldest_wait_ms": 0.0 if oldest is None else (now - oldest) * 1000.0,
                "arrivals": self.queue.arrivals, "arrived_prompt_tokens": self.arrived_prompt_tokens,
                "arrived_prompt_tokens_sq": self.arrived_prompt_tokens_sq,
                "rejected": self.queue.rejected, "cancelled": self.queue.cancelled,
                "dispatched": self.queue.dispatched, "max_queued": self.config.flow.max_queued,
                "dispatch_wait_ms": self.config.flow.dispatch_wait_ms}

    def _queue_gauges(self) -> None:
        self.metrics.queue_depth.set(len(self.queue))
        self.metrics.queue_prompt_tokens.set(self.queue.queued_prompt_tokens)

    async def _wait_in_queue(self, request: Request, info: RequestInfo, received: float, seq: int,
                             exclude: frozenset[str], front: bool) -> tuple[Replica, Choice, list[int], int] | Response:
        """Queue the request and wait for its dispatch, its client leaving, or the queue timeout."""
        key = self._next_key = self._next_key + 1
        hashes = prefix_hashes(info.prompt_text, self.block_chars) if self.config.policy == "slo-aware" else []
        future: asyncio.Future = asyncio.get_running_loop().create_future()
        if not self.queue.push(Queued(key, received, info.prompt_tokens, exclude), front=front):
            self.metrics.arrivals.inc()
            self.metrics.queue_rejected.inc()
            return error_json(429, f"the router's queue is full ({self.config.flow.max_queued} requests waiting); "
                              "retry shortly", "queue_full", kind="rate_limit_error")
        if not front:
            self.metrics.arrivals.inc()
            self.arrived_prompt_tokens += info.prompt_tokens
            self.arrived_prompt_tokens_sq += info.prompt_tokens ** 2
        self._waiters[key] = (future, info, hashes, seq)
        self.dispatch()
        if future.done():
            return future.result()
        self._queue_gauges()
        left = asyncio.ensure_future(_client_left(request))
        outcome = "dispatched"
        try:
            while not future.done():
                now = time.perf_counter()
                if now - received >= self.config.queue_timeout_s:
                    outcome = "timeout"
                    break
                if not self.pool.healthy() and now - self._last_healthy_at >= self.config.no_replica_wait_s:
                    outcome = "no_replica"  # every replica down for a while: say so rather than hold the client
                    break
                await asyncio.wait((future, left), timeout=min(0.25, self.config.queue_timeout_s - (now - received)),
                                   return_when=asyncio.FIRST_COMPLETED)
                if left.done() and not future.done():
                    outcome = "left"
                    break
        finally:
            left.cancel()
        if future.done() and not future.cancelled():
            return future.result()
        future.cancel()
        self._waiters.pop(key, None)
        gone = self.queue.cancel(key)
        self._queue_gauges()
        if outcome == "left":
            self.metrics.queue_cancelled.inc()
            return Response(status_code=499)  # nobody reads it: the client is gone
        if gone:
            self.queue.cancelled -= 1  # not a client leaving
        if outcome == "no_replica":
            self.metrics.unroutable.inc()
            return error_json(503, "no replica is ready to take requests; retry shortly", "no_ready_replica")
        self.metrics.queue_timeouts.inc()
        return error_json(503, f"no replica could start the request within {self.config.queue_timeout_s:g}s "
                          "in the router's queue", "queue_timeout")

    def _reserve(self, replica: Replica, tokens: int, now_s: float) -> int:
        """Counted at dispatch, before any await: the next dispatch sees this request on its replica.
        Returns the ticket its first byte (or failure) settles on the replica's prefill clock."""
        self._next_ticket += 1
        replica.outstanding += 1
        replica.clock.dispatched(self._next_ticket, tokens, replica.prefill_tokens_per_ms() * 1000.0, now_s)
        self.metrics.in_flight.inc()
        return self._next_ticket

    def _unreserve(self, replica: Replica, ticket: int) -> None:
        replica.outstanding -= 1
        replica.clock.forget(ticket, time.perf_counter())
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

    def choose(self, info: RequestInfo, exclude: set[str], seq: int) -> tuple[Replica, Choice, list[int], int] | None:
        """An immediate pick (requests that do not queue: GETs), among the healthy replicas not excluded."""
        healthy = [r for r in self.pool.healthy() if r.name not in exclude]
        if not healthy:
            return None
        hashes = prefix_hashes(info.prompt_text, self.block_chars) if self.config.policy == "slo-aware" else []
        now = time.perf_counter()
        choice = self._pick(info, hashes, [r.view(now) for r in healthy], [r.name for r in healthy], seq)
        replica = self.pool.replicas[choice.name]
        return replica, choice, hashes, self._reserve(replica, info.prompt_tokens, now)

    # -- one request ------------------------------------------------------------------------------
    async def handle(self, request: Request, path: str) -> Response:
        received = time.perf_counter()
        body = await request.body()
        info = read_request(body, self.config.chars_per_token) if request.method == "POST" else RequestInfo(False, "", 0)
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in _DROP_HEADERS]
        url_path = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        tried: set[str] = set()
        last_refusal: RetryElsewhere | None = None
        queued = request.method == "POST" and self.config.flow_control
        self.counter += 1  # once per request: a retry must not shift round-robin's order
        seq = self.counter
        for attempt in range(MAX_ATTEMPTS):
            if queued:
                picked = await self._wait_in_queue(request, info, received, seq, frozenset(tried), front=attempt > 0)
                if isinstance(picked, Response):
                    return picked
            else:
                picked = self.choose(info, tried, seq)
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
            leg_headers = headers + [(QUEUE_HEADER, f"{waited_ms:.1f}")] if queued else headers
            try:
                return await self._send(replica, choice, ticket, request.method, url_path, leg_headers, body, info,
                                        received)
            except RetryElsewhere as exc:
                last_refusal = exc
                log.info("retrying %s elsewhere: %s on %s", url_path, exc.reason, replica.name)
        if last_refusal is not None and last_refusal.response is not None:
            return _passthrough(last_refusal.response, last_refusal.body)
        self.metrics.unroutable.inc()
        if last_refusal is not None:
            return error_json(503, f"no replica could take the request (last: {last_refusal.reason})",
                              "no_ready_replica")
        return error_json(503, "no replica is ready to take requests; retry shortly", "no_ready_replica")

    async def _send(self, replica: Replica, choice: Choice, ticket: int, method: str, path: str, headers,
                    body: bytes, info: RequestInfo, received: float) -> Response:
        assert self.client is not None
        state = {"open": True, "prefilled": False}  # reserved on the replica at dispatch (_reserve)

        def prefilled() -> None:
            if not state["prefilled"]:
                state["prefilled"] = True
                replica.clock.prefilled(ticket, time.perf_counter())
                self.dispatch()  # its prefill is done: the replica may take the next one

        def release() -> None:
            if state["open"]:
                state["open"] = False
                if not state["prefilled"]:  # failed before its first byte: nothing was prefilled
                    state["prefilled"] = True
                    replica.clock.forget(ticket, time.perf_counter())
                replica.outstanding -= 1
                self.metrics.in_flight.dec()
                self.dispatch()  # a running slot is free

        response: httpx.Response | None = None
        try:
            upstream = self.client.build_request(method, replica.url + path, headers=headers, content=body)
            response, first = await self._first_byte(replica, upstream)
        except BaseException:
            if response is not None:
                await _close(response)
            release()
            raise
        prefilled()
        elapsed = time.perf_counter() - received
        self.metrics.observed_ttft.labels(self.config.policy).observe(elapsed)
        if choice.predicted_ttft_ms is not None:
            self.metrics.ttft_error.labels(self.config.policy).observe(abs(elapsed - choice.predicted_ttft_ms / 1000))
        out_headers = {k: v for k, v in response.headers.items() if k.lower() not in _DROP_RESPONSE_HEADERS}
        out_headers["x-stallfree-replica"] = replica.name
        if not info.stream or response.status_code != 200 or \
                not response.headers.get("content-type", "").startswith("text/event-stream"):
            iterator = response.extensions.get("router_iterator")
            try:
                rest = [chunk async for chunk in iterator] if iterator is not None else []
            except httpx.HTTPError as exc:
                release()
                await _close(response)
                raise RetryElsewhere(f"{type(exc).__name__} reading the body") from None
            release()
            await _close(response)
            content = b"".join([first or b"", *rest])
            return Response(content, status_code=response.status_code, headers=out_headers)
        return StreamingResponse(self._relay(replica, response, first, release), status_code=response.status_code,
                                 headers=out_headers)

    async def _first_byte(self, replica: Replica, upstream: httpx.Request) -> tuple[httpx.Response, bytes | None]:
        """Send and wait for the first body chunk, or give up as soon as the replica turns unhealthy."""
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

        task = asyncio.ensure_future(first())
        waiter = asyncio.ensure_future(down.wait())
        try:
            await asyncio.wait((task, waiter), return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            if "response" in holder:
                await _close(holder["response"])
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

    async def _relay(self, replica: Replica, response: httpx.Response, first: bytes | None, release):
        iterator = response.extensions.get("router_iterator")
        try:
            if first:
                yield first
            if iterator is not None:
                async for chunk in iterator:
                    yield chunk
        except (httpx.HTTPError, OSError) as exc:
            self.metrics.stream_errors.labels(replica.name).inc()
            yield sse_error(f"the replica serving this stream failed mid-stream ({type(exc).__name__}); "
                            "the request did not complete", "upstream_failed")
            yield b"data: [DONE]\n\n"
        finally:
            release()
            await _close(response)


async def _client_left(request: Request) -> None:
    """Returns when the client disconnects (the body was read already: the next message is the disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _close(response: httpx.Response) -> None:
    # Shielded: on a client disconnect this runs inside a cancelled scope, and the upstream must still close.
    with anyio.CancelScope(shield=True):
        await response.aclose()


def _passthrough(response: httpx.Response, body: bytes) -> Response:
    headers = {k: v for k, v in response.headers.items() if k.lower() not in _DROP_RESPONSE_HEADERS}
    return Response(body, status_code=response.status_code, headers=headers)


def create_app(router: Router) -> FastAPI:
    # No trailing-slash redirects: their Location would be built from the client's Host header.
    app = FastAPI(title="stallfree router", docs_url=None, redoc_url=None, openapi_url=None, redirect_slashes=False)
    app.state.router = router

    @app.get("/health")
    async def health() -> JSONResponse:
        return JSONResponse({"status": "ok"})

    @app.get("/ready")
    async def ready() -> JSONResponse:
        healthy = router.pool.healthy()
        if not healthy:
            return JSONResponse({"ready": False, "reason": "no ready replica",
                                 "replicas": {r.name: r.reason for r in router.pool.replicas.values()}},
                                status_code=503)
        return JSONResponse({"ready": True, "replicas_healthy": len(healthy)})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(router.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/router/replicas")
    async def replicas() -> JSONResponse:
        """What the router sees of each replica (for people and benchmarks)."""
        out = {}
        for r in router.pool.replicas.values():
            view = r.view(time.perf_counter())
            out[r.name] = {"url": r.url, "healthy": r.healthy, "reason": r.reason, "outstanding": r.outstanding,
                           "queued_prefill_tokens": view.queued_prefill_tokens,
                           "prefill_tokens_per_ms": view.prefill_tokens_per_ms, "step_ms": view.step_ms,
                           "max_num_seqs": view.max_num_seqs}
        return JSONResponse(out)

    @app.get("/router/queue")
    async def queue() -> JSONResponse:
        """The flow-control queue, as the control loop reads it (observe_router.py)."""
        return JSONResponse(router.queue_status())

    @app.api_route("/v1/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH"])
    async def v1(request: Request, path: str) -> Response:
        return await router.handle(request, path)

    return app
