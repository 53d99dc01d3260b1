"""n-gram (prompt-lookup) drafting: per request, the tokens that followed the latest earlier occurrence of its last
n tokens, with the draft length adapted to what the request's drafts have been accepted at.

No torch: the scheduler proposes drafts (engine/scheduler.py `_schedule_drafts`), the executor verifies them
(engine/draft_verifier.py), the scheduler keeps what was accepted (update_from_output).

Lookup: an index per n-gram size of (n tokens) -> the position after their latest occurrence that has a token after
it, extended as tokens arrive (never rebuilt), so a proposal costs a few dict reads, not a scan of the context.

Adaptation, per request (`DraftState`): the next draft is at most one token longer than the last one's accepted run
(all accepted: it grows by `GROW`), within [1, max_draft]. Acceptance is an exponential average over the tokens
drafted; under `min_acceptance` the request stops drafting for a cooldown of iterations, doubled each time a probe
(one short draft after the cooldown) fails again and reset once drafts pay. A request whose output does not repeat
its context thus pays one probe row every few hundred tokens at most, and nothing when no n-gram matches.
"""
from __future__ import annotations

from dataclasses import dataclass

from stallfree.node_daemon.engine.sampling_params import SamplingParams

GROW = 2  # tokens a fully accepted draft grows the next one by
PROBE_LEN = 2  # the draft length of a probe after a cooldown
FIRST_COOLDOWN = 16  # iterations without drafting after acceptance first falls below the floor
MAX_COOLDOWN = 512
ACCEPTANCE_MEMORY = 0.7  # weight of the past in the acceptance average (per verification)
MIN_VERIFICATIONS = 2  # verifications before the average may switch drafting off


@dataclass(frozen=True)
class SpeculativeConfig:
    """`method`: "ngram" (prompt lookup) or "off". `max_draft`: tokens a draft proposes at most; `ngram_max` down to
    `ngram_min`: the suffix lengths looked up, longest first; `min_acceptance`: the share of drafted tokens accepted
    under which a request stops drafting (for a cooldown, then probes again). `max_rows`: drafts only while the
    iteration's decodes and draft tokens stay within this many rows, where its projections are still bound by
    reading the weights, so a verified token costs a fraction of a decode (past it, about what a decode row costs,
    and a draft pays only at near-perfect acceptance); 0: the executor's (`speculation_rows`)."""

    method: str = "off"
    max_draft: int = 8
    ngram_max: int = 3
    ngram_min: int = 2
    min_acceptance: float = 0.3
    max_rows: int = 0

    def __post_init__(self) -> None:
        if self.method not in ("off", "ngram"):
            raise ValueError(f"speculative method must be ngram or off, got {self.method!r}")
        if self.max_draft < 1:
            raise ValueError(f"the speculative draft length must be at least 1, got {self.max_draft}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"n-gram sizes need 1 <= ngram_min <= ngram_max, got {self.ngram_min}, {self.ngram_max}")
        if not 0.0 <= self.min_acceptance < 1.0:
            raise ValueError(f"min_acceptance must be in [0, 1), got {self.min_acceptance}")
        if self.max_rows < 0:
            raise ValueError(f"max_rows must be >= 0 (0: the executor's), got {self.max_rows}")

    @property
    def enabled(self) -> bool:
        return self.method != "off"


def can_draft(sampling: SamplingParams, constrained: bool) -> bool:
    """Whether a request's outputs stay exact with drafts verified in one forward.

    Not for: a grammar (each draft token would need the mask of the state after the ones before it), penalties (each
    row's logits depend on the drafts before it as history), seeded random sampling (the seed promises the same
    tokens on every run; accepted drafts would make them depend on the load, which sets the draft lengths)."""
    if constrained or sampling.needs_history:
        return False
    return sampling.greedy or sampling.seed is None


class DraftState:
    """One request's n-gram index and draft-length adaptation; its counters feed the usage and /metrics."""

    __slots__ = ("config", "_index", "_indexed", "next_len", "acceptance", "verifications", "cooldown",
                 "_next_cooldown", "num_drafted", "num_accepted", "num_verifications")

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self._index: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(config.ngram_min,
                                                                                      config.ngram_max + 1)}
        self._indexed = 0  # positions (ends of n-grams) indexed so far
        self.next_len = min(4, config.max_draft)
        self.acceptance = 0.5  # a neutral prior: two drafts in a row not accepted switch drafting off
        self.verifications = 0
        self.cooldown = 0  # iterations left without drafting
        self._next_cooldown = FIRST_COOLDOWN
        self.num_drafted = 0
        self.num_accepted = 0
        self.num_verifications = 0

    def draft_len(self) -> int:
        """Tokens this iteration's draft may propose (0: not drafting now); counts one iteration of a cooldown."""
        if self.cooldown:
            self.cooldown -= 1
            if self.cooldown:
                return 0
            self.next_len = PROBE_LEN  # a probe: short, then grown if it pays
        return self.next_len

    def propose(self, tokens: list[int], limit: int) -> list[int]:
        """Up to `limit` tokens that followed the latest earlier occurrence of the longest matching suffix."""
        end = len(tokens)
        self._extend(tokens, end - 1)  # n-grams ending before the last token: each has a token after it
        for n, index in sorted(self._index.items(), reverse=True):
            if n > end:
                continue
            at = index.get(tuple(tokens[end - n:]))
            if at is not None:
                return tokens[at:min(at + limit, end)]
        return []

    def _extend(self, tokens: list[int], upto: int) -> None:
        start = self._indexed  # the first n-gram end not indexed yet
        if upto < start:
            return
        for n, index in self._index.items():
            for e in range(max(start, n), upto + 1):
                index[tuple(tokens[e - n:e])] = e
        self._indexed = upto + 1

    def observe(self, drafted: int, accepted: int) -> None:
        """A verification's outcome: adapt the next draft's length and, under the floor, cool down."""
        self.num_drafted += drafted
        self.num_accepted += accepted
        self.num_verifications += 1
        self.verifications += 1
        rate = accepted / drafted
        self.acceptance = ACCEPTANCE_MEMORY * self.acceptance + (1 - ACCEPTANCE_MEMORY) * rate
        config = self.config
        if accepted == drafted:
            self.next_len = min(config.max_draft, drafted + GROW)
        else:
            self.next_len = max(1, min(config.max_draft, accepted + 1))
        if self.verifications >= MIN_VERIFICATIONS and self.acceptance < config.min_acceptance:
            self.cooldown = self._next_cooldown
            self._next_cooldown = min(MAX_COOLDOWN, 2 * self._next_cooldown)
            # The probe after the cooldown is judged alone, from the floor: one good draft resumes drafting.
            self.verifications = MIN_VERIFICATIONS - 1
            self.acceptance = config.min_acceptance
        elif self.acceptance >= 2 * config.min_acceptance:
            self._next_cooldown = FIRST_COOLDOWN
