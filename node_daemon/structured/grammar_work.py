"""Grammar work (building, checking and compiling a request's schema) off the event loop, bounded in time.

Checking a schema costs more than linear time in its size (thousands of properties: seconds), so it never runs
on the event loop: a few worker threads of their own do it (the library drops the GIL inside), and a request
whose grammar is not ready within `deadline_s` is refused before it is admitted: a 400 when its own work ran past
the bound (the schema is too complex), a 503 with Retry-After when it never got a worker (others' schemas held
them all). A thread cannot be stopped, so the size bound (grammar.MAX_GRAMMAR_CHARS) is what bounds the work
that goes on after its deadline.

The work must not take a core from the forward's threads: beside them it stretched every step (558 ms gaps for a
7,000-property schema on SmolLM2 with two cores). Nor may it run at a lower CPU priority: a thread at nice 19
takes the GIL now and then (each return from the library), and under Python's forced switching the thread that
hands it over waits until the starved thread is scheduled, so every stream waited on it (200-360 ms gaps). So the
workers run at the process's priority and busy() tells the engine that grammar work is running: it gives the
workers a core (model_executor.py, one torch thread fewer) until they are done. A job that starts while the
engine is stepping waits for that hand-off (at most HANDOFF_WAIT_S): started in the middle of a forward it
oversubscribed the cores for that whole step (250 ms instead of 20).
"""
from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, TypeVar

T = TypeVar("T")

DEFAULT_WORKERS = 2

HANDOFF_WAIT_S = 0.5  # the longest a job waits for the engine to leave it a core
ENGINE_ACTIVE_S = 0.1  # an engine that began a step this recently is stepping

_running = 0  # grammar jobs running now, in every pool (busy())
_running_lock = threading.Lock()
_core = threading.Condition()
_core_left = False  # the engine's forward runs a thread fewer for grammar work (or has one thread anyway)
_engine_step_at = float("-inf")


def busy() -> bool:
    """Whether any grammar work is running (the engine then leaves it a core)."""
    return _running > 0


def engine_stepping(core_left: bool) -> None:
    """The CPU engine, at each step: whether its forward leaves grammar work a core now."""
    global _core_left, _engine_step_at
    with _core:
        _engine_step_at, _core_left = time.monotonic(), core_left
        _core.notify_all()


def _wait_for_a_core() -> None:
    """While the engine is stepping and has not left grammar work a core, wait for it (HANDOFF_WAIT_S at most)."""
    deadline = time.monotonic() + HANDOFF_WAIT_S
    with _core:
        while not _core_left and time.monotonic() - _engine_step_at < ENGINE_ACTIVE_S:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            _core.wait(remaining)


DEFAULT_DEADLINE_S = 10.0  # the largest grammar accepted checks in about 2 s on one quiet core: room for a busy one


class GrammarTooSlow(ValueError):
    """The request's own grammar work ran past the deadline: the schema is too complex (a 400)."""


class GrammarBusy(Exception):
    """Every worker was busy with other requests' grammars until the deadline (a 503: retry)."""


class GrammarWork:
    def __init__(self, workers: int = DEFAULT_WORKERS, deadline_s: float = DEFAULT_DEADLINE_S) -> None:
        if workers < 1 or not deadline_s > 0:
            raise ValueError("grammar work needs at least one worker and a positive deadline")
        self.deadline_s = deadline_s
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="grammar-work")

    async def run(self, fn: Callable[..., T], *args, deadline_s: float | None = None) -> T:
        """fn(*args) on a worker, or GrammarTooSlow / GrammarBusy past the deadline (default: this pool's)."""
        deadline_s = self.deadline_s if deadline_s is None else deadline_s
        started = threading.Event()

        def job() -> T:
            global _running
            started.set()
            with _running_lock:
                _running += 1
            try:
                _wait_for_a_core()
                return fn(*args)
            finally:
                with _running_lock:
                    _running -= 1

        future = self._pool.submit(job)
        try:
            return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), deadline_s)
        except asyncio.TimeoutError:
            if future.cancel() or not started.is_set():
                raise GrammarBusy(f"the grammar workers were busy for {deadline_s:g} s") from None
            raise GrammarTooSlow(f"checking the schema took longer than {deadline_s:g} s (on a busy server the "
                                 "check gets only the CPU that serving leaves): simplify it (fewer properties, "
                                 "alternatives or nested definitions)") from None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


grammar_work = GrammarWork()
