"""The router's probe listener: /health and /ready on a port of their own (`stallfree router --probe-port`).

On the serving port a connection flood (the connection cap plus a few silent connections, reopened) turns
/health into a refused connection, and a kubelet restarts a router that is only busy. This listener has no
connection cap and carries no client traffic, so liveness says only that the process and its event loop run (it
shares the serving loop: a wedged loop still fails it). /ready here is the router's readiness without the
serving port's cap (the serving port's own /ready reports the cap).
"""
from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

if TYPE_CHECKING:
    from stallfree.operator.router.proxy import Router


def create_probe_app(router: Router) -> Starlette:
    async def health(request: Request) -> JSONResponse:
        return JSONResponse({"status": "ok"})

    async def ready(request: Request) -> JSONResponse:
        healthy = len(router.pool.healthy())
        reason = "draining" if router.draining else None if healthy else "no ready replica"
        if reason is not None:
            return JSONResponse({"ready": False, "reason": reason, "replicas_healthy": healthy}, status_code=503)
        return JSONResponse({"ready": True, "replicas_healthy": healthy})

    return Starlette(routes=[Route("/health", health), Route("/ready", ready)])


class ProbeServer(uvicorn.Server):
    """uvicorn for the probe app; the serving server owns the signals (its SIGTERM drains both)."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


def probe_server(router: Router, host: str, port: int, log_level: str) -> ProbeServer:
    return ProbeServer(uvicorn.Config(create_probe_app(router), host=host, port=port, log_level=log_level,
                                      access_log=False, lifespan="off", timeout_graceful_shutdown=1))
