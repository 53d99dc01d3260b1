"""The daemon's start-up as explicit phases: starting -> loading model -> (profiling) -> ready, or failed.

The HTTP server answers from the first moment while a start-up thread loads the model; that thread alone moves
the phase, only forward. What the server needs from the loaded engine arrives as one frozen `Serving`, published
before the phase turns ready: a request never sees an engine without its vocabulary or KV capacity. The engine's
profile is the one thing handed over again later (`give_profile`, from the engine thread's idle re-measure).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Callable

from stallfree.contracts import Profile
from stallfree.node_daemon.engine.engine_protocol import EngineClient
from stallfree.node_daemon.engine.request_rules import RequestLimits

if TYPE_CHECKING:
    from stallfree.node_daemon.server.structured_requests import StructuredOutputs


class Phase(Enum):
    STARTING = "starting"
    LOADING = "loading model"
    PROFILING = "profiling"
    READY = "ready"
    FAILED = "failed"


_NEXT = {
    Phase.STARTING: {Phase.LOADING, Phase.FAILED},
    Phase.LOADING: {Phase.PROFILING, Phase.READY, Phase.FAILED},
    Phase.PROFILING: {Phase.READY, Phase.FAILED},
    Phase.READY: set(),
    Phase.FAILED: set(),
}


@dataclass
class LiveCounts:
    """What the engine holds right now (the last iteration's counts go stale when it idles)."""

    num_waiting: int
    num_running: int
    kv_usage: float
    num_partial_prefills: int = 0
    kv_reserved: float = 0.0  # fraction of KV blocks in use or reserved for admitted requests' growth


@dataclass(frozen=True)
class Serving:
    """What the server reads from the running engine, handed over once when the start-up is done."""

    engine: EngineClient
    limits: RequestLimits  # what the engine can serve: every request is checked against it before admission
    # The longest text one token can stand for: a prompt longer than this times the context is refused before it
    # is tokenized. None: unknown (always tokenize).
    max_chars_per_token: int | None
    live_counts: Callable[[], LiveCounts]
    engine_error: Callable[[], str | None]  # None while the engine loop is healthy, else why not
    # response_format and tools for the loaded model (structured_requests.py); None: refused with a 400
    structured: StructuredOutputs | None = None


class StartUp:
    """The phase and, once ready, the `Serving`; moved by the start-up thread, read by the server."""

    def __init__(self) -> None:
        self._phase = Phase.STARTING
        self._serving: Serving | None = None
        self._failure: str | None = None
        self._profile: Profile | None = None
        self._lock = threading.Lock()

    @property
    def phase(self) -> Phase:
        return self._phase

    @property
    def serving(self) -> Serving | None:
        """None until the phase is ready."""
        return self._serving if self._phase is Phase.READY else None

    @property
    def failure(self) -> str | None:
        return self._failure

    @property
    def profile(self) -> Profile | None:
        """The engine's profile, None until one is read or measured."""
        return self._profile

    def give_profile(self, profile: Profile) -> None:
        """A profile replaces the last one whole (a Profile is never changed in place): the start-up thread's,
        then each the engine thread measures while idle."""
        self._profile = profile

    def advance(self, phase: Phase) -> None:
        """Move forward to `phase` (not ready nor failed: those carry what they need); a step back is a bug."""
        if phase in (Phase.READY, Phase.FAILED):
            raise ValueError(f"use ready() or failed() to reach {phase.value}")
        self._move(phase)

    def ready(self, serving: Serving) -> None:
        with self._lock:
            self._check(Phase.READY)
            self._serving = serving  # published before the phase: whoever sees ready sees it
            self._phase = Phase.READY

    def failed(self, reason: str) -> None:
        with self._lock:
            if self._phase is Phase.FAILED:
                return
            self._check(Phase.FAILED)
            self._failure = reason
            self._phase = Phase.FAILED

    def not_serving_reason(self) -> str | None:
        """None once ready; else what /ready and a 503 say (the phase, or why the start-up failed)."""
        phase = self._phase
        if phase is Phase.READY:
            return None
        if phase is Phase.FAILED:
            return f"start-up failed: {self._failure}"
        return phase.value

    def _move(self, phase: Phase) -> None:
        with self._lock:
            self._check(phase)
            self._phase = phase

    def _check(self, phase: Phase) -> None:
        if phase not in _NEXT[self._phase]:
            raise RuntimeError(f"start-up cannot go from {self._phase.value} to {phase.value}")
