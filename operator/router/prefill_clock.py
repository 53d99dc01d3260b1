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

Each pending request keeps its priority and tenant, because the engine prefills higher bands first: a request
of priority p starts after the pending work of priority >= p only, and pushes the lower bands' predicted ends
later by its own prefill. `queued_by_class` splits what is queued by (priority, tenant), so flow control can
judge a request against only what is ahead of it (flow_control.py).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Hashable


@dataclass
class _Pending:
    tokens: int
    finish_s: float  # predicted end of its prefill
    priority: int = 0
    tenant: str = ""


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

    def dispatched(self, key: Hashable, tokens: int, tokens_per_s: float, now_s: float, priority: int = 0,
                   tenant: str = "") -> float:
        """A request sent at `now_s`; returns its predicted prefill end. It goes after the pending work of its
        priority and higher, before the lower bands' (their predicted ends move later by its prefill)."""
        rate = max(tokens_per_s, 1e-9)
        duration = max(0, tokens) / rate
        lower = [p for p in self._pending.values() if p.priority < priority]
        if not lower:
            start = max(now_s, self.busy_until_s)
        else:
            ahead = sum(self._left(p, rate, now_s) for p in self._pending.values() if p.priority >= priority)
            start = now_s + ahead / rate
            for p in lower:
                p.finish_s = max(p.finish_s, now_s) + duration
        finish = start + duration
        self.busy_until_s = max(self.busy_until_s, now_s) + duration if lower else finish
        self._pending[key] = _Pending(tokens, finish, priority, tenant)
        return finish

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

    @staticmethod
    def _left(pending: _Pending, tokens_per_s: float, now_s: float) -> float:
        """Of one pending prompt, what is still to prefill: the part of it its predicted end leaves after now."""
        return min(float(pending.tokens), max(0.0, pending.finish_s - now_s) * tokens_per_s)

    def queued_by_class(self, tokens_per_s: float, now_s: float) -> dict[tuple[int, str], int]:
        """(priority, tenant) -> prefill tokens still queued of that class (each prompt's part left after now)."""
        out: dict[tuple[int, str], int] = {}
        for p in self._pending.values():
            left = self._left(p, tokens_per_s, now_s)
            if left > 0:
                out[(p.priority, p.tenant)] = out.get((p.priority, p.tenant), 0) + int(left)
        return out

    def queued_tokens(self, tokens_per_s: float, now_s: float) -> int:
        """Prefill tokens still ahead of a request sent now, never more than what was sent and not answered."""
        if not self._pending:
            return 0
        ahead = max(0.0, self.busy_until_s - now_s) * tokens_per_s
        return int(min(ahead, self.pending_tokens))
