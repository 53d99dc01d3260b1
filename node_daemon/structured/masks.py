"""Token masks for a step's constrained rows, computed while the forward runs, applied just before sampling.

Each step: after sampling step N and accept()ing its tokens, the engine asks the MaskFiller for the constrained
rows' masks (one future a row, keyed by the request and how many tokens its grammar has accepted); the worker
thread computes them while the forward of step N+1 runs (the library, numpy and torch release the GIL for the heavy
parts); when the logits are back the engine takes the masks that are ready and calls apply_masks() on them before
the sampler. The worker also turns the bitmask into an additive bias (0 or -inf per token), so the critical path is
one add_ per run of consecutive constrained rows; the unconstrained rows are never touched.

A mask can cost far more than a step: a schema of thousands of properties took over 100 ms for some states. The
engine does not hold the other rows for it (model_executor.py MASK_WAIT_S): the row sits the step out and asks
again, and the same key finds the computation already under way.
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

from stallfree.node_daemon.structured.matcher import Matcher, bitmask_words


@dataclass
class StepMasks:
    """The masks of one step's constrained rows, in the order they were submitted."""

    bias: torch.Tensor  # [rows, vocab]: 0 where a token is allowed, -inf where not
    dead: list[int] = field(default_factory=list)  # positions (into the submitted list) with no allowed token

    @property
    def num_rows(self) -> int:
        return self.bias.shape[0]


def fill_masks(matchers: Sequence[Matcher], vocab_size: int, dtype: torch.dtype = torch.float32) -> StepMasks:
    """The masks of `matchers` now, on the calling thread (MaskFiller runs this on its worker)."""
    bitmask = torch.zeros((len(matchers), bitmask_words(vocab_size)), dtype=torch.int32)
    dead = [i for i, m in enumerate(matchers) if not m.fill_mask(bitmask[i])]
    # little-endian bit order matches the library's layout: token t is bit t % 32 of word t // 32
    allowed = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")[:, :vocab_size]
    blocked = ~torch.from_numpy(allowed).view(torch.bool)
    bias = torch.zeros((len(matchers), vocab_size), dtype=dtype).masked_fill_(blocked, float("-inf"))
    return StepMasks(bias, dead)


def apply_masks(logits: torch.Tensor, rows: Sequence[int], masks: StepMasks) -> None:
    """Forbid, in place, what each constrained row's grammar forbids: logits[rows[i]] gets masks row i.

    Logits wider than the masks (a model vocab padded past the tokenizer's) get -inf past the mask's width.
    """
    if len(rows) != masks.num_rows:
        raise ValueError(f"{len(rows)} rows for {masks.num_rows} masks")
    if not rows:
        return
    width = masks.bias.shape[1]
    if logits.shape[1] < width:
        raise ValueError(f"logits of {logits.shape[1]} tokens for masks of {width}")
    bias = masks.bias.to(device=logits.device, dtype=logits.dtype, non_blocking=True)
    # One add_ per run of consecutive rows (all rows constrained: one add_): index_add_ takes a slow path on
    # -inf that costs milliseconds at 16 rows.
    for start, first, count in _runs(rows):
        logits[first:first + count, :width].add_(bias[start:start + count])
        if logits.shape[1] > width:
            logits[first:first + count, width:] = float("-inf")


def _runs(rows: Sequence[int]) -> list[tuple[int, int, int]]:
    """(position in rows, first row, length) of each run of consecutive rows."""
    runs: list[tuple[int, int, int]] = []
    for position, row in enumerate(rows):
        if runs and runs[-1][1] + runs[-1][2] == row:
            start, first, count = runs[-1]
            runs[-1] = (start, first, count + 1)
        else:
            runs.append((position, row, 1))
    return runs


class MaskFiller:
    """One worker thread that computes constrained rows' masks while the caller runs the forward.

    masks_for() returns a Future of a one-row StepMasks per matcher: the one already pending for the same key
    (request id, tokens accepted) when its row waited out a step, else a new one. A matcher must not be touched
    (accept) until its future is done: the caller accepts only rows whose mask it took.
    """

    def __init__(self, vocab_size: int, dtype: torch.dtype = torch.float32) -> None:
        self.vocab_size = vocab_size
        self.dtype = dtype
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-masks")
        self._pending: dict[tuple[str, int], Future[StepMasks]] = {}
        self._late: set[Future[StepMasks]] = set()  # masks a step did not wait for (late())

    def masks_for(self, rows: Sequence[tuple[str, Matcher]]) -> list[Future[StepMasks]]:
        """A future of each (request id, matcher)'s mask now; taken() once its result is used."""
        futures = []
        for request_id, matcher in rows:
            key = (request_id, matcher.num_accepted)
            future = self._pending.get(key)
            if future is None:
                future = self._pending[key] = self._pool.submit(fill_masks, [matcher], self.vocab_size, self.dtype)
            futures.append(future)
        return futures

    def mark_late(self, future: Future[StepMasks]) -> None:
        """A step went on without this mask (it was not ready in time)."""
        self._late.add(future)

    def late(self) -> bool:
        """Whether a mask that a step went on without is still being computed (a slow grammar state)."""
        self._late = {future for future in self._late if not future.done()}
        return bool(self._late)

    def taken(self, request_id: str, matcher: Matcher) -> None:
        """The row's mask was used: the next one is for its next token."""
        self._pending.pop((request_id, matcher.num_accepted), None)

    def forget(self, request_id: str) -> None:
        """The request is gone: drop its pending masks (a running computation finishes unread)."""
        for key in [key for key in self._pending if key[0] == request_id]:
            del self._pending[key]

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
