"""What a CPU daemon serves on a slower path than the compiled forward over the file's own codes, one line each.

A daemon that quietly serves on a fallback is several times slower than its profile's peers expect, and nothing in
its latency says why. These lines go to the start-up log as warnings, to /metrics (`stallfree_slow_path`, one
series a line) and into /admin/stats, from which the operator writes the InferenceService's ServingPath condition.
An empty list: every matrix is served from its codes (or is a float weight) by the compiled forward.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from stallfree.node_daemon.models.loader import LoadedModel


def slow_paths(loaded: "LoadedModel", compiled: bool, why_not_compiled: str | None) -> list[str]:
    """`compiled`: whether the compiled forward serves now; `why_not_compiled`: why not (models/cpu_decode.py)."""
    found = []
    if not compiled:
        found.append(f"forward: python ({why_not_compiled or 'compiling'})")
    dtype = str(loaded.dtype).removeprefix("torch.")
    for kind, count in sorted(loaded.dequantized.items()):
        found.append(f"weights: {count} {kind} matrices dequantized to {dtype} (no code kernel for {kind} at their "
                     f"width)")
    return found
