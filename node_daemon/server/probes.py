"""The probe listener: /health and /ready on a port of their own (`--probe-port`).

On the serving port, a connection flood past `--max-connections` plus the probe slots turns /health into a
refused connection, and a kubelet restarts a daemon that is only busy (a restart loop an attacker can
drive). This listener has no connection cap and carries no client traffic, so liveness reports only what
it should: the process and its engine loop are alive. It runs on the serving event loop, so a wedged
loop still fails it. /ready here ignores the serving port's cap (the serving port's /ready reports it).
"""
from __future__ import annotations

import contextlib

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route


def health_response(daemon) -> JSONResponse:
    """200 while the engine loop runs (or is still starting); 500 once it died."""
    error = daemon.engine_error() if daemon.engine is not None else None
    if error is not None:
        return JSONResponse({"status": "unhealthy", "reason": error}, status_code=500)
    return JSONResponse({"status": "ok"})


def create_probe_app(daemon) -> Starlette:
    async def health(request: Request) -> JSONResponse:
        return health_response(daemon)

    async def ready(request: Request) -> JSONResponse:
        reason = daemon.not_ready_reason()
        if reason is not None:
            return JSONResponse({"ready": False, "reason": reason}, status_code=503)
        return JSONResponse({"ready": True})

    return Starlette(routes=[Route("/health", health), Route("/ready", ready)])


class ProbeServer(uvicorn.Server):
    """uvicorn for the probe app; the serving server owns the signals (its SIGTERM drains both)."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


def probe_server(daemon, host: str, port: int, log_level: str) -> ProbeServer:
    config = uvicorn.Config(create_probe_app(daemon), host=host, port=port, log_level=log_level,
                            access_log=False, lifespan="off", timeout_graceful_shutdown=1)
    return ProbeServer(config)
