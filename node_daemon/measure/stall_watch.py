"""StallWatch: a slow turn of the engine loop is logged with its cause, never silent.

A turn is applying the queued commands, one `LLMEngine.step()` and handing the outputs over. When a
turn takes longer than `min_s` and, per scheduled token, `factor` times the recent median (so a long
prefill chunk is not a stall, a decode step as long as one is), one warning line says where the
time went: the commands, the step, the hand-off, garbage collection (any thread's: the collector holds
the GIL), and how much of the turn the engine thread and the whole process were on a CPU. An engine
thread off its CPU while the process was not either means other processes took the cores; a busy
process with an idle engine thread means another of its threads (the HTTP event loop) held the GIL.
"""
from __future__ import annotations

import gc
import logging
import statistics
import time
from collections import deque

log = logging.getLogger("stallfree.engine.stall")


def compute_threads() -> int:
    """torch's CPU threads (1 without torch): what an unimpeded engine process keeps busy."""
    try:
        import torch

        return torch.get_num_threads()
    except ImportError:
        return 1


class StallWatch:
    def __init__(self, min_s: float = 0.5, factor: float = 4.0, history: int = 64, threads: int = 1) -> None:
        self.min_s = min_s
        self.threads = max(1, threads)  # compute threads: an unimpeded process burns about this many CPU seconds a second
        self.factor = factor
        self.recent: deque[float] = deque(maxlen=history)
        self.gc_s = 0.0
        self.gc_count = 0
        self.gc_max_generation = -1
        self._gc_started: float | None = None
        self.stalls = 0
        gc.callbacks.append(self._on_gc)

    def close(self) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_started = time.perf_counter()
        elif self._gc_started is not None:
            self.gc_s += time.perf_counter() - self._gc_started
            self.gc_count += 1
            self.gc_max_generation = max(self.gc_max_generation, info.get("generation", -1))
            self._gc_started = None

    def begin(self) -> tuple[float, float, float, float, int]:
        self.gc_max_generation = -1
        return time.perf_counter(), time.thread_time(), time.process_time(), self.gc_s, self.gc_count

    def end(self, began: tuple[float, float, float, float, int], commands_s: float, step_s: float,
            deliver_s: float, tokens: int) -> bool:
        """Record the turn; True (and a warning line) if it was a stall."""
        wall0, thread0, process0, gc0, gcn0 = began
        wall = time.perf_counter() - wall0
        per_token = wall / max(tokens, 1)
        recent = self.recent
        typical = statistics.median(recent) if len(recent) >= 8 else None
        recent.append(per_token)
        if wall < self.min_s or typical is None or per_token < self.factor * typical:
            return False
        self.stalls += 1
        thread_cpu = time.thread_time() - thread0
        process_cpu = time.process_time() - process0
        gc_s, gc_n = self.gc_s - gc0, self.gc_count - gcn0
        if gc_s > 0.5 * wall:
            cause = f"garbage collection (generation {self.gc_max_generation})"
        elif thread_cpu < 0.5 * wall and process_cpu < 0.5 * wall * self.threads:
            cause = "the process was off the CPU: other processes took the cores"
        elif thread_cpu < 0.5 * wall:
            cause = "the engine thread waited while the process ran: another thread held the GIL"
        else:
            cause = "the engine thread was computing (a slow step)"
        log.warning("engine stall: a turn took %.0f ms for %d tokens (median %.1f ms a token): commands %.0f ms, step %.0f ms, "
                    "hand-off %.0f ms, GC %.0f ms in %d collections; engine thread on CPU %.0f ms, process CPU %.0f ms"
                    " -> %s", wall * 1e3, tokens, typical * 1e3, commands_s * 1e3, step_s * 1e3, deliver_s * 1e3,
                    gc_s * 1e3, gc_n, thread_cpu * 1e3, process_cpu * 1e3, cause)
        return True
