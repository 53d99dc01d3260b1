"""The router's HTTP edge: which requests it serves and the doors every body passes, before proxy.py sees it.

In order, per request (the connection cap and the header deadline come first, in uvicorn's protocol:
http_doors/connections.py, set up by `stallfree router`):
- the path (paths.py): OpenAI's routes go to a replica, the router's own (`/health`, `/ready`, `/metrics`,
  `/router/*`) are answered here, anything else is a 404 and a known path with another method a 405;
- the body (the daemon's own doors, http_doors/): 413 past `max_body_bytes` (after reading and dropping the
  rest, so every client reads it), 408 past the body deadline, JSON bounded and checked before it is parsed,
  large bodies parsed on a worker thread (400s in OpenAI's shape); the parse is left for proxy.py;
- then proxy.Router.serve. No traceback reaches a client: a bug is a 500 with a message only.

Replica addresses (`/router/replicas`, the `x-stallfree-replica` header, the `replica` label in `/metrics`) and the
queue's state (`/router/queue`) are shown only to a request with the admin token; /ready says how many replicas
are healthy, not which.
"""
from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fastapi import FastAPI
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from stallfree.http_doors.body_guard import BodyGuardMiddleware
from stallfree.http_doors.body_limit import BodyLimitMiddleware, drain
from stallfree.http_doors.connections import CONNECTIONS_FULL
from stallfree.http_doors.error_json import error_body
from stallfree.operator.router.forwarding import is_admin
from stallfree.operator.router.paths import route

if TYPE_CHECKING:
    from stallfree.operator.router.proxy import Router

log = logging.getLogger("stallfree.router")

UPSTREAM_PATH = "stallfree.upstream_path"  # the scope key: the path paths.route built for the replica
# More request headers than this is a 431 before anything else: real clients send a few dozen, and the cost of a
# request must stay linear in what it sends.
MAX_HEADERS = 128
# A refused request's body is read and dropped up to this, so that the client reads the answer.
_REFUSED_DRAIN_BYTES, _REFUSED_DRAIN_S = 1 << 20, 2.0


@dataclass(frozen=True)
class Doors:
    max_body_bytes: int = 4 << 20  # as the daemon's default: a body a replica would take passes
    body_timeout_s: float = 30.0


def create_app(router: Router, doors: Doors = Doors()) -> ASGIApp:
    own = _own_endpoints(router)
    refused = router.metrics.refused

    async def openai(scope: Scope, receive: Receive, send: Send) -> None:
        await router.serve(scope, receive, send, scope[UPSTREAM_PATH])

    # The last wrapped runs first: the size cap, then the body deadline and the JSON checks.
    guarded = BodyLimitMiddleware(BodyGuardMiddleware(openai, doors.body_timeout_s,
                                                      on_refused=lambda reason: refused.labels(reason).inc()),
                                  doors.max_body_bytes, on_refused=lambda: refused.labels("too_large").inc(),
                                  drain_timeout_s=doors.body_timeout_s)

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await own(scope, receive, send)
            return
        method, path = scope["method"], scope["path"]
        where = route(method, path)
        if len(scope["headers"]) > MAX_HEADERS:
            refused.labels("too_many_headers").inc()
            await _refuse(receive, send, 431, f"{len(scope['headers'])} request headers; at most {MAX_HEADERS} are "
                          "accepted", "too_many_headers")
        elif where is None:
            refused.labels("not_found").inc()
            await _refuse(receive, send, 404, f"no route {method} {path[:200]}", "not_found")
        elif where.kind == "method":
            refused.labels("method_not_allowed").inc()
            await _refuse(receive, send, 405, f"method {method} not allowed on {path}", "method_not_allowed",
                          [(b"allow", ", ".join(where.methods).encode())])
        elif where.kind == "own":
            await own(scope, receive, send)
        else:
            scope[UPSTREAM_PATH] = where.path
            await _no_trace(guarded, scope, receive, send)

    return app


def without_replicas(exposition: bytes) -> bytes:
    """A Prometheus text exposition less every sample that carries a `replica` label."""
    return b"\n".join(line for line in exposition.split(b"\n") if b'replica="' not in line or line.startswith(b"#"))


async def _no_trace(app: ASGIApp, scope: Scope, receive: Receive, send: Send) -> None:
    """Run `app`; a bug becomes a 500 with a message (if nothing was sent yet) and a trace in the log only."""
    started = False

    async def tracking_send(message) -> None:
        nonlocal started
        if message["type"] == "http.response.start":
            started = True
        await send(message)

    try:
        await app(scope, receive, tracking_send)
    except Exception:  # noqa: BLE001 - the edge of the process: nothing may escape to uvicorn's traceback page
        log.exception("unhandled error on %s %s", scope["method"], scope["path"])
        if not started:
            await _send_error(send, 500, "internal router error", "internal_error")


async def _refuse(receive: Receive, send: Send, status: int, message: str, code: str,
                  extra: list[tuple[bytes, bytes]] = ()) -> None:
    await drain(receive, 0, _REFUSED_DRAIN_BYTES, _REFUSED_DRAIN_S)
    await _send_error(send, status, message, code, [*extra, (b"connection", b"close")])


async def _send_error(send: Send, status: int, message: str, code: str,
                      extra: list[tuple[bytes, bytes]] = ()) -> None:
    body = json.dumps(error_body(status, message, code=code)).encode()
    await send({"type": "http.response.start", "status": status, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *extra]})
    await send({"type": "http.response.body", "body": body})


def _own_endpoints(router: Router) -> FastAPI:
    # No OpenAPI schema, no docs; no trailing-slash redirects (their Location came from the client's Host header).
    app = FastAPI(title="stallfree router", docs_url=None, redoc_url=None, openapi_url=None, redirect_slashes=False)
    app.state.router = router

    @app.get("/health")
    async def health() -> JSONResponse:
        return JSONResponse({"status": "ok"})

    @app.get("/ready")
    async def ready(request: Request) -> JSONResponse:
        healthy = router.pool.healthy()
        reason = ("draining" if router.draining else
                  "connections full: this router holds its maximum of open connections"
                  if request.scope.get(CONNECTIONS_FULL) else None if healthy else "no ready replica")
        if reason is not None:
            return JSONResponse({"ready": False, "reason": reason, "replicas_healthy": len(healthy)},
                                status_code=503)
        return JSONResponse({"ready": True, "replicas_healthy": len(healthy)})

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        """Every series to a scraper with the admin token; to anyone else, none that names a replica (its
        address)."""
        text = generate_latest(router.metrics.registry)
        if not is_admin(request.scope["headers"], router.admin_token):
            text = without_replicas(text)
        return Response(text, media_type=CONTENT_TYPE_LATEST)

    @app.get("/router/replicas")
    async def replicas(request: Request) -> JSONResponse:
        """What the router sees of each replica (for people and benchmarks): with the admin token only."""
        if not router.admin_token:
            return JSONResponse(error_body(403, "the router has no admin token: /router/replicas is closed",
                                           code="admin_closed"), status_code=403)
        if not is_admin(request.scope["headers"], router.admin_token):
            return JSONResponse(error_body(401, "/router/replicas needs the admin token (Authorization: Bearer)",
                                           code="unauthorized"), status_code=401,
                                headers={"WWW-Authenticate": "Bearer"})
        out = {}
        for r in router.pool.replicas.values():
            view = r.view(time.perf_counter())
            out[r.name] = {"url": r.url, "healthy": r.healthy, "reason": r.reason, "outstanding": r.outstanding,
                           "queued_prefill_tokens": view.queued_prefill_tokens,
                           "prefill_tokens_per_ms": view.prefill_tokens_per_ms, "step_ms": view.step_ms,
                           "max_num_seqs": view.max_num_seqs}
        return JSONResponse(out)

    @app.get("/router/queue")
    async def queue(request: Request) -> JSONResponse:
        """The flow-control queue, as the control loop reads it (observe_router.py, with the admin token): a router
        with an admin token shows it to no one else."""
        if router.admin_token and not is_admin(request.scope["headers"], router.admin_token):
            return JSONResponse(error_body(401, "/router/queue needs the admin token (Authorization: Bearer)",
                                           code="unauthorized"), status_code=401,
                                headers={"WWW-Authenticate": "Bearer"})
        return JSONResponse(router.queue_status())

    return app
