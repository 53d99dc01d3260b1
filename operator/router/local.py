"""The router inside another program's event loop (the local runtime behind `stallfree up`).

Its replica set is handed in (`follow`) whenever the caller's set changes, instead of being read from
EndpointSlices; everything else is the same router: its own health polls, picks, metrics, HTTP edge. Its
objectives may be replaced while it runs (`set_objectives`): the demo sizes their targets after it started.
"""
from __future__ import annotations

import asyncio

import uvicorn

from stallfree.net import free_port
from stallfree.operator.router.objectives import Objectives
from stallfree.operator.router.proxy import Router, RouterConfig, create_app
from stallfree.operator.router.replicas import ReplicaPool
from stallfree.ready import NotReadyInTime, wait_until_ready_async


class InProcessRouter:
    def __init__(self, admin_token: str | None, config: RouterConfig | None = None, host: str = "127.0.0.1",
                 port: int = 0) -> None:
        self.router = Router(ReplicaPool(admin_token), config or RouterConfig())
        self.host, self.port = host, port
        self._server: uvicorn.Server | None = None
        self._task: asyncio.Task | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self) -> str:
        if not self.port:
            self.port = free_port()
        await self.router.start()
        self._server = uvicorn.Server(uvicorn.Config(create_app(self.router), host=self.host, port=self.port,
                                                     log_level="warning", access_log=False, lifespan="off"))
        self._server.install_signal_handlers = lambda: None  # the caller owns the signals
        self._task = asyncio.create_task(self._server.serve())
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises the start-up failure
            await asyncio.sleep(0.02)
        return self.url

    def follow(self, replicas: dict[str, str]) -> None:
        """name -> URL of every replica that may serve (not draining); health is the router's own poll."""
        self.router.pool.set_replicas(replicas)

    def set_objectives(self, objectives: Objectives) -> None:
        """The objectives each new request is judged by (queued ones keep the band and deadline they got)."""
        self.router.use_objectives(objectives)

    async def wait_ready(self, timeout_s: float = 10.0) -> bool:
        """Until the router's own poll found a replica ready (its first poll follows `follow` closely)."""
        try:
            await wait_until_ready_async(self.has_ready_replica, timeout_s, poll_s=0.05, what="the router")
        except NotReadyInTime:
            return False
        return True

    def has_ready_replica(self) -> bool:
        return bool(self.router.pool.healthy())

    async def close(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)
        await self.router.close()
