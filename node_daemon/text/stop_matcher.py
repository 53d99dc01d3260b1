"""Stop strings found as the text grows, at a cost per character that does not depend on how many there are.

An Aho-Corasick automaton over the stop strings, built once per request (work: their total length). Its state
after each character is the longest tail of the text that is still the start of some stop string, so it carries
everything earlier text can contribute: new text is fed once and never scanned again. Per character, the work is
one transition plus failure links, at most the longest stop string's length and at most 2 per character on average.

Which stop wins: the first to be complete as the text grows (the one ending first); of those ending at the same
character, the longest. This does not depend on how the text was split into tokens.
"""
from __future__ import annotations

from collections import deque
from typing import Sequence


class StopMatcher:
    __slots__ = ("_goto", "_fail", "_depth", "_out", "_state", "steps")

    def __init__(self, stops: Sequence[str]) -> None:
        goto: list[dict[str, int]] = [{}]
        depth = [0]
        out: list[str | None] = [None]  # the longest stop string ending at this node (its own, else via failure)
        for stop in stops:
            if not stop:
                continue
            node = 0
            for ch in stop:
                nxt = goto[node].get(ch)
                if nxt is None:
                    nxt = len(goto)
                    goto[node][ch] = nxt
                    goto.append({})
                    depth.append(depth[node] + 1)
                    out.append(None)
                node = nxt
            out[node] = stop
        fail = [0] * len(goto)
        queue = deque(goto[0].values())
        while queue:  # breadth first: a node's failure target is shallower, so already final
            node = queue.popleft()
            for ch, child in goto[node].items():
                f = fail[node]
                while f and ch not in goto[f]:
                    f = fail[f]
                target = goto[f].get(ch, 0)
                fail[child] = target if target != child else 0
                if out[child] is None:
                    out[child] = out[fail[child]]
                queue.append(child)
        self._goto, self._fail, self._depth, self._out = goto, fail, depth, out
        self._state = 0
        self.steps = 0  # transitions and failure links followed: the work done, for tests

    @property
    def held(self) -> int:
        """Characters at the end of the text fed so far that could still grow into a stop string."""
        return self._depth[self._state]

    def feed(self, text: str) -> tuple[int, str] | None:
        """Feed new text; (end, stop) when a stop string completes, `end` its exclusive end within `text`."""
        goto, fail, out = self._goto, self._fail, self._out
        state, steps = self._state, self.steps
        for i, ch in enumerate(text):
            while True:
                steps += 1
                nxt = goto[state].get(ch)
                if nxt is not None:
                    state = nxt
                    break
                if state == 0:
                    break
                state = fail[state]
            if out[state] is not None:
                self._state, self.steps = state, steps
                return i + 1, out[state]
        self._state, self.steps = state, steps
        return None
