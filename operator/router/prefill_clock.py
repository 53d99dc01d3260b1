"""How much prefill a replica still has queued, as the router can know it: pure (the caller passes the clock).

The router cannot see a replica's prefill progress: a request shows only when its first byte comes back.
Counting every dispatched prompt as queued until then overstates the backlog by the prompt being
prefilled, so flow control would feed a replica one prompt at a time and let it idle between them.
Instead each replica gets a drain clock: it prefills what the router sent in dispatch order at its
(calibrated) rate, so a request dispatched at `t` onto a clock that runs until `busy_until` is predicted
to finish at `max(t, busy_until) + tokens / rate`, and what is left queued at `now` is
`(busy_until - now) * rate`. Each first byte corrects the clock: a prompt that finished earlier or later
than predicted moves everything dispatched after it by as much, so a replica slower than its rate
accumulates no hidden backlog, and a faster one is fed sooner.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Hashable


@dataclass
class _Pending:
    tokens: int
    finish_s: float  # predicted end of its prefill


@dataclass
class PrefillClock:
    busy_until_s: float = 0.0
    _pending: "OrderedDict[Hashable, _Pending]" = field(default_factory=OrderedDict)

    def __len__(self) -> int:
        return len(self._pending)

    @property
    def pending_tokens(self) -> int:
        """Prompt tokens sent and not yet answered with a first byte (an upper bound on what is queued)."""
        return sum(p.tokens for p in self._pending.values())

    def dispatched(self, key: Hashable, tokens: int, tokens_per_s: float, now_s: float) -> float:
        """A request sent at `now_s`; returns its predicted prefill end."""
        start = max(now_s, self.busy_until_s)
        self.busy_until_s = start + max(0, tokens) / max(tokens_per_s, 1e-9)
        self._pending[key] = _Pending(tokens, self.busy_until_s)
        return self.busy_until_s

    def prefilled(self, key: Hashable, now_s: float) -> None:
        """Its first byte came back at `now_s`: the requests sent after it move by its prediction's error."""
        pending = self._pending.pop(key, None)
        if pending is None:
            return
        error = now_s - pending.finish_s
        for other in self._pending.values():
            if other.finish_s > pending.finish_s:  # sent after it: prefilled after it
                other.finish_s += error
        self._settle(now_s)

    def forget(self, key: Hashable, now_s: float) -> None:
        """It failed or was given back before its first byte: its share of the clock goes."""
        pending = self._pending.pop(key, None)
        if pending is None:
            return
        self._settle(now_s)

    def _settle(self, now_s: float) -> None:
        ends = [p.finish_s for p in self._pending.values()]
        self.busy_until_s = max(ends) if ends else min(self.busy_until_s, now_s)

    def queued_tokens(self, tokens_per_s: float, now_s: float) -> int:
        """Prefill tokens still ahead of a request sent now, never more than what was sent and not answered."""
        if not self._pending:
            return 0
        ahead = max(0.0, self.busy_until_s - now_s) * tokens_per_s
        return int(min(ahead, self.pending_tokens))
