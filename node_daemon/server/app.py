"""The FastAPI app factory: one daemon's state, its routes, the error handlers and the body limit.

The engine runs its loop in its own thread (AsyncEngine); this app only validates, admits, streams and
reports, on the HTTP event loop. Tokenizing and chat templating of large prompts run on a small bounded
pool of worker threads (the tokenizer releases the GIL), so one huge prompt delays only itself.
Everything a route needs hangs off one frozen `Daemon` object on app.state; the engine comes with the start-up's
`Serving` once it is ready, the profile through the start-up's hand-off (startup.py).
"""
from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from stallfree.contracts import Profile
from stallfree.node_daemon.engine.engine_protocol import EngineClient
from stallfree.node_daemon.engine.request_rules import RequestLimits
from stallfree.node_daemon.server.metrics import EngineMetrics
from stallfree.node_daemon.server.auth import Auth
from stallfree.node_daemon.server.backpressure import AdmissionControl
from stallfree.http_doors.body_guard import BodyGuardMiddleware
from stallfree.http_doors.body_limit import BodyLimitMiddleware
from stallfree.http_doors.connections import CONNECTIONS_FULL
from stallfree.node_daemon.server.drain import DrainState
from stallfree.node_daemon.server.errors import APIError, install_error_handlers
from stallfree.node_daemon.server.probes import health_response
from stallfree.node_daemon.server.startup import LiveCounts, StartUp
from stallfree.node_daemon.measure.stats_window import StatsWindow

DEFAULT_MAX_BODY_BYTES = 4 << 20
DEFAULT_BODY_TIMEOUT_S = 30.0
DEFAULT_TEXT_WORKERS = 2
# Texts shorter than this are tokenized inline: a thread hop costs more than encoding them.
INLINE_TEXT_CHARS = 8192


@dataclass(frozen=True)
class Daemon:
    """What every route needs; the engine and what comes with it arrive through `startup` once it is ready."""

    metrics: EngineMetrics
    stats: StatsWindow
    admission: AdmissionControl
    drain: DrainState
    auth: Auth
    served_model_name: str
    startup: StartUp = field(default_factory=StartUp)
    tpot_slo_ms: float | None = None
    text_workers: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(DEFAULT_TEXT_WORKERS, thread_name_prefix="stallfree-text"))
    created: int = field(default_factory=lambda: int(time.time()))
    # Aborts that run after a client left; kept so the tasks are not garbage-collected mid-flight.
    background: set = field(default_factory=set)

    @property
    def profile(self) -> Profile | None:
        """Measured at start-up, or later on the idle engine (startup.give_profile)."""
        return self.startup.profile

    @property
    def engine(self) -> EngineClient | None:
        serving = self.startup.serving
        return None if serving is None else serving.engine

    @property
    def vocab_size(self) -> int | None:
        serving = self.startup.serving
        return None if serving is None else serving.limits.vocab_size

    @property
    def structured(self):
        """response_format and tools for the loaded model (server/structured_requests.py), None when unavailable."""
        serving = self.startup.serving
        return None if serving is None else serving.structured

    @property
    def kv_capacity_tokens(self) -> int | None:
        """The whole KV cache in tokens: no request may need more."""
        serving = self.startup.serving
        return None if serving is None else serving.limits.kv_capacity_tokens

    @property
    def max_chars_per_token(self) -> int | None:
        serving = self.startup.serving
        return None if serving is None else serving.max_chars_per_token

    def live_counts(self) -> LiveCounts | None:
        """What the engine holds now (read by the gauges at scrape); None before it runs."""
        serving = self.startup.serving
        return None if serving is None else serving.live_counts()

    def engine_error(self) -> str | None:
        """None while the engine loop is healthy (or not started yet), else why not (a dead loop fails /health)."""
        serving = self.startup.serving
        return None if serving is None else serving.engine_error()

    def not_ready_reason(self) -> str | None:
        if self.drain.draining:
            return "draining"
        return self.startup.not_serving_reason() or self.engine_error()

    async def text_work(self, size: int, fn: Callable[..., Any], *args: Any) -> Any:
        """fn(*args) inline for small texts, else on the bounded text worker pool (off the event loop)."""
        if size < INLINE_TEXT_CHARS:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self.text_workers, fn, *args)

    def require_limits(self) -> RequestLimits:
        """What the engine can serve (engine/request_rules.py), or 503 while the daemon starts."""
        self.require_engine()
        return self.startup.serving.limits

    def require_engine(self) -> EngineClient:
        """The engine, or 503 while the daemon starts (a client retries; a probe waits)."""
        serving = self.startup.serving
        if serving is None:
            raise APIError(503, f"the daemon is starting ({self.startup.not_serving_reason()}); retry shortly",
                           code="starting", reason="starting", headers={"Retry-After": "5"})
        return serving.engine


def get_daemon(request: Request) -> Daemon:
    return request.app.state.daemon


def create_app(daemon: Daemon, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S) -> FastAPI:
    from stallfree.node_daemon.server.admin_routes import router as admin_router
    from stallfree.node_daemon.server.openai_routes import router as openai_router

    # The OpenAPI schema is served (clients and fuzzers read it); the interactive docs pages are not.
    # No trailing-slash redirects: Starlette builds their Location from the client's Host header (an open
    # redirect); "/health/" is a 404 like any unknown path.
    app = FastAPI(title="stallfree daemon", docs_url=None, redoc_url=None, openapi_url="/openapi.json",
                  redirect_slashes=False)
    app.state.daemon = daemon
    install_error_handlers(app, daemon.metrics.record_error)
    daemon.metrics.bind_live(daemon.live_counts)
    # The last added runs first: the size cap, then the body deadline and JSON checks.
    app.add_middleware(BodyGuardMiddleware, body_timeout_s=body_timeout_s, on_refused=daemon.metrics.record_error)
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_body_bytes, drain_timeout_s=body_timeout_s,
                       on_refused=lambda: daemon.metrics.record_error("too_large"))
    app.include_router(openai_router)
    app.include_router(admin_router)

    # Both probes answer even past the connection cap (connections.py keeps slots for them); only readiness
    # reports the cap: a full daemon is alive, and should get no new work.
    # Kept on the serving port for compatibility; a kubelet asks the probe port's (probes.py), which no
    # connection flood reaches.
    @app.get("/health")
    async def health() -> JSONResponse:
        return health_response(daemon)

    @app.get("/ready")
    async def ready(request: Request) -> JSONResponse:
        reason = daemon.not_ready_reason()
        if reason is None and request.scope.get(CONNECTIONS_FULL):
            reason = "connections full: this server holds its maximum of open connections"
        if reason is not None:
            return JSONResponse({"ready": False, "reason": reason}, status_code=503)
        return JSONResponse({"ready": True})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(daemon.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app

