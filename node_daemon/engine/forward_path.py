"""Which forward an iteration takes, chosen in one place: the model runner's `ForwardPath`.

Three paths: a captured CUDA graph (decode-only iterations on CUDA, engine/cuda_graphs.py), the compiled CPU forward
(models/cpu_decode.py), or the eager Python forward. The compiled forward may finish compiling on a build thread
at any moment while the Python path serves; this object takes it up only between two forwards, on the engine thread
(`begin_iteration`): the quantized matmuls' code kernel is switched on and torch's int4 packs are released there,
so no iteration runs half on one kernel and half on the other, nor reads a pack another thread just dropped.
"""
from __future__ import annotations

from enum import Enum
from typing import Any, Callable


class Path(Enum):
    CUDA_GRAPH = "cuda graph"
    COMPILED = "compiled"
    EAGER = "eager"


class ForwardPath:
    def __init__(self, cuda_graphs: Any | None, compiled: Any | None, compiled_loaded: Callable[[], bool],
                 take_up_compiled: Callable[[], None]) -> None:
        """`compiled_loaded()`: whether the compiled forward's library has loaded (on any thread);
        `take_up_compiled()`: what switching to it takes (the code kernel on, torch's int4 packs released), run
        once, between iterations."""
        self.cuda_graphs = cuda_graphs
        self.compiled = compiled
        self._compiled_loaded = compiled_loaded
        self._take_up_compiled = take_up_compiled
        self.compiled_in_use = False
        self.begin_iteration()

    def begin_iteration(self) -> None:
        """Take up a compiled forward that has loaded since the last forward (a no-op once it is in use)."""
        if self.compiled is not None and not self.compiled_in_use and self._compiled_loaded():
            self._take_up_compiled()
            self.compiled_in_use = True

    def choose(self, num_tokens: int, decode_only: bool, graph_inputs: Any = None) -> Path:
        graphs = self.cuda_graphs
        if graphs is not None and decode_only and graphs.can_run(graph_inputs):
            return Path.CUDA_GRAPH
        if self.compiled_in_use and self.compiled is not None and self.compiled.can_run(num_tokens, decode_only):
            return Path.COMPILED
        return Path.EAGER
