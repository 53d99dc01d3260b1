"""Several EngineObservers behind the engine's one observer slot (metrics and the stats window, at least)."""
from __future__ import annotations

from stallfree.node_daemon.engine.engine_protocol import EngineObserver, IterationRecord
from stallfree.node_daemon.engine.request import Request


class FanoutObserver:
    """Calls each observer in order; the bound methods are collected once so the per-token call stays a loop."""

    def __init__(self, *observers: EngineObserver) -> None:
        self.observers = observers
        self._on_iteration = tuple(o.on_iteration for o in observers)
        self._on_token = tuple(o.on_token for o in observers)
        self._on_finished = tuple(o.on_finished for o in observers)

    def on_iteration(self, record: IterationRecord) -> None:
        for call in self._on_iteration:
            call(record)

    def on_token(self, request: Request, now: float, first: bool) -> None:
        for call in self._on_token:
            call(request, now, first)

    def on_finished(self, request: Request, now: float) -> None:
        for call in self._on_finished:
            call(request, now)
