"""Grammar work (building, checking and compiling a request's schema) off the event loop, bounded in time.

Checking a schema costs more than linear time in its size (thousands of properties: seconds), so it never runs
on the event loop: a few worker threads of their own do it (the library drops the GIL inside), and a request
whose grammar is not ready within `deadline_s` is refused before it is admitted: a 400 when its own work ran past
the bound (the schema is too complex), a 503 with Retry-After when it never got a worker (others' schemas held
them all). A thread cannot be stopped, so the size bound (grammar.MAX_GRAMMAR_CHARS) is what bounds the work
that goes on after its deadline.

The workers run at the lowest CPU priority (nice 19, per thread): a schema that checks for seconds beside the
forward's threads took one of the two cores from them, and every stream's next token waited (558 ms gaps for a
7,000-property schema on SmolLM2 with two cores). An idle daemon still checks at full speed; a busy one gives the
check what serving leaves, and past the deadline refuses it.
"""
from __future__ import annotations

import asyncio
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, TypeVar

T = TypeVar("T")

DEFAULT_WORKERS = 2
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
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="grammar-work",
                                        initializer=_lowest_priority)

    async def run(self, fn: Callable[..., T], *args, deadline_s: float | None = None) -> T:
        """fn(*args) on a worker, or GrammarTooSlow / GrammarBusy past the deadline (default: this pool's)."""
        deadline_s = self.deadline_s if deadline_s is None else deadline_s
        started = threading.Event()

        def job() -> T:
            started.set()
            return fn(*args)

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


def _lowest_priority() -> None:
    """This worker thread at nice 19 (Linux sets priority per thread); elsewhere it keeps the process's."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):
        pass


grammar_work = GrammarWork()
