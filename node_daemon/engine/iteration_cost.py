"""What a prefill chunk's cached prefix adds to an iteration, learned online, so that the token budget keeps
meaning an iteration time for long prompts too.

The start-up profile times fresh prompts over no cached prefix, and the budget is chosen (by the daemon from
its TPOT SLO, or by the operator) as the tokens whose iteration fits a time. A chunk of a long prompt's tail
attends to every token before it, so at the same token count it runs longer than the profile says (here,
SmolLM2 on 2 cores: a 256-token chunk beside 4 decodes about 1.3x as long over a 1,280-token prefix as over
none), and the decodes beside it stall for that long. This model fits, over the iterations served
(least squares, older ones forgotten geometrically),

    ms = speed * profile(tokens) + per_prefix_pair * sum(chunk tokens * prefix length)
         + per_context_token * sum(decode context lengths)

and the scheduler cuts a chunk over a prefix until profile(tokens) plus its prefix cost, in the profile's
time (per_prefix_pair / speed: a busy machine slows everything alike, which is the operator's to answer with
the budget), fits the profile's time for the full budget; when the daemon holds a TPOT SLO, also the SLO's
iteration target at the machine's speed as fitted. A chunk over no prefix is never cut, and no chunk
is cut below MIN_CHUNK tokens, so a prompt always progresses. Until chunks over a prefix have been served,
the prefix term keeps its prior: from the model's shape, attention's FLOPs per (query, key) pair against the
projections' FLOPs per token, at the profile's cost per token (prior_per_prefix_pair).
"""
from __future__ import annotations

from typing import Sequence

from stallfree.contracts import Profile
from stallfree.profile_rules import budget_for_tpot
from stallfree.shapes import ModelShape

# Weight of an iteration against the one after it: about the last 1 / (1 - FORGET) = 50 iterations count.
FORGET = 0.98
# Prior weight on (speed 1, no context terms): a handful of iterations' worth, so one odd iteration
# cannot swing the fit, and terms that no iteration has exercised stay at their prior.
PRIOR_WEIGHT = 4.0
SPEED_RANGE = (0.5, 4.0)  # a fit outside this is noise or a pause, not the machine's speed
OUTLIER_RATIO = 2.0
MIN_CHUNK = 32  # tokens a chunk over a prefix keeps whatever its prefix costs
CHUNK_ALIGN = 16


class OnlineIterationCost:
    """An iteration-time model over a measured Profile, refitted by observe() after each served iteration."""

    def __init__(self, profile: Profile, iteration_target_ms: float | None = None,
                 prior_ms_per_prefix_pair: float = 0.0) -> None:
        """`iteration_target_ms`: when the daemon holds a TPOT SLO, the iteration time (as observed, at the
        machine's fitted speed) that a chunk over a prefix may not exceed either. `prior_ms_per_prefix_pair`:
        the prefix term before any chunk over a prefix is served (prior_per_prefix_pair gives one from the
        model's shape), so a daemon's first long prompt is cut too."""
        if not profile.mixed:
            raise ValueError("an iteration cost model needs a profile with mixed points")
        if iteration_target_ms is not None and not iteration_target_ms > 0:
            raise ValueError(f"an iteration target must be positive, got {iteration_target_ms}")
        self.profile = profile
        self.iteration_target_ms = iteration_target_ms
        # Normal equations of the weighted least squares, and the iterations' total weight.
        self._xtx = [[0.0] * 3 for _ in range(3)]
        self._xty = [0.0] * 3
        self._weight = 0.0
        self._prior = (1.0, max(0.0, prior_ms_per_prefix_pair), 0.0)
        # (speed, ms per prefix pair, ms per decode context token), solved when next read: a decode-only
        # iteration only adds to the sums, the solve waits for a chunk to cut.
        self._coefficients = self._prior
        self._stale = False

    @property
    def coefficients(self) -> tuple[float, float, float]:
        if self._stale:
            self._coefficients, self._stale = self._solve(), False
        return self._coefficients

    @coefficients.setter
    def coefficients(self, value: tuple[float, float, float]) -> None:
        self._coefficients, self._stale = tuple(value), False

    def base_ms(self, decode_context_lens: Sequence[int], prefill_chunks: Sequence[tuple[int, int]]) -> float:
        """The profile's time for this many tokens (decode-only curve when nothing prefills)."""
        if not prefill_chunks:
            return self.profile.decode_ms_at(len(decode_context_lens)) if decode_context_lens else 0.0
        return self.profile.iteration_ms_at(len(decode_context_lens) + sum(n for _, n in prefill_chunks))

    def chunk_within_budget(self, limit: int, used: int, prefix_len: int, token_budget: int) -> int:
        """Tokens of a chunk over `prefix_len` cached tokens, at most `limit`, beside `used` tokens already in the
        iteration, whose iteration with its prefix cost fits the profile's time for `token_budget` tokens."""
        speed, per_pair, _ = self.coefficients
        if prefix_len <= 0 or per_pair <= 0 or limit <= MIN_CHUNK:
            return limit
        per_token = per_pair * prefix_len / speed  # this chunk's prefix cost per token, in the profile's time
        target = self.profile.iteration_ms_at(token_budget)
        if self.iteration_target_ms is not None:
            target = min(target, self.iteration_target_ms / speed)
        fits = lambda n: self.profile.iteration_ms_at(used + n) + per_token * n <= target  # noqa: E731
        if fits(limit):
            return limit
        lo, hi = MIN_CHUNK, limit  # the answer is in [MIN_CHUNK, limit)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if fits(mid):
                lo = mid
            else:
                hi = mid
        # Whole multiples of CHUNK_ALIGN: fewer distinct GEMM shapes, each of which oneDNN builds once.
        return max(MIN_CHUNK, lo - lo % CHUNK_ALIGN)

    def budget_for_tpot(self, tpot_ms: float) -> int:
        """The token budget for a TPOT target at the machine's fitted speed: the start-up's rule
        (profile_rules.budget_for_tpot) on the target in the profile's time. The scheduler caps an iteration at it
        while a running request's own TPOT target is tighter than the service's."""
        return budget_for_tpot(self.profile, tpot_ms / self.coefficients[0])

    def predict_ms(self, decode_context_lens: Sequence[int], prefill_chunks: Sequence[tuple[int, int]]) -> float:
        speed, per_pair, per_context = self.coefficients
        pairs = sum(prefix * n for prefix, n in prefill_chunks)
        return (speed * self.base_ms(decode_context_lens, prefill_chunks) + per_pair * pairs
                + per_context * sum(decode_context_lens))

    def observe(self, decode_context_lens: Sequence[int], prefill_chunks: Sequence[tuple[int, int]],
                iteration_ms: float) -> None:
        """Fold one served iteration's measured time into the fit."""
        base = self.base_ms(decode_context_lens, prefill_chunks)
        if base <= 0 or iteration_ms <= 0:
            return
        x = (base, float(sum(prefix * n for prefix, n in prefill_chunks)), float(sum(decode_context_lens)))
        # A pause (swap, a stopped process, a collection) is not the machine's speed: each iteration may pull
        # the fit at most OUTLIER_RATIO away from what the last solved fit predicts.
        predicted = sum(c * xi for c, xi in zip(self._coefficients, x))
        iteration_ms = min(max(iteration_ms, predicted / OUTLIER_RATIO), predicted * OUTLIER_RATIO)
        xtx, xty = self._xtx, self._xty
        self._weight = FORGET * self._weight + 1.0
        for i in range(3):
            xty[i] = FORGET * xty[i] + x[i] * iteration_ms
            row = xtx[i]
            for j in range(3):
                row[j] = FORGET * row[j] + x[i] * x[j]
        self._stale = True

    def _solve(self) -> tuple[float, float, float]:
        # Ridge towards the prior, PRIOR_WEIGHT iterations' worth of each term's mean square: scale-free, and
        # a term no iteration has exercised (all zeros) stays at its prior.
        a = [row[:] for row in self._xtx]
        b = self._xty[:]
        for i, prior in enumerate(self._prior):
            ridge = PRIOR_WEIGHT * a[i][i] / max(self._weight, 1.0) + 1e-12
            a[i][i] += ridge
            b[i] += ridge * prior
        solution = _solve3(a, b)
        if solution is None:
            return self._coefficients
        speed, per_pair, per_context = solution
        speed = min(max(speed, SPEED_RANGE[0]), SPEED_RANGE[1])
        return speed, max(0.0, per_pair), max(0.0, per_context)


def _solve3(a: list[list[float]], b: list[float]) -> tuple[float, float, float] | None:
    """Gaussian elimination with partial pivoting for a 3x3 system; None when singular."""
    m = [row[:] + [rhs] for row, rhs in zip(a, b)]
    for col in range(3):
        pivot = max(range(col, 3), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) < 1e-18:
            return None
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(col + 1, 3):
            f = m[r][col] / m[col][col]
            for c in range(col, 4):
                m[r][c] -= f * m[col][c]
    x = [0.0, 0.0, 0.0]
    for r in (2, 1, 0):
        x[r] = (m[r][3] - sum(m[r][c] * x[c] for c in range(r + 1, 3))) / m[r][r]
    return x[0], x[1], x[2]


def prior_per_prefix_pair(profile: Profile, shape: ModelShape) -> float:
    """ms a (chunk token, cached prefix token) pair costs, guessed before any is measured: attention does
    4 * heads * head_dim FLOPs a pair in every layer (scores and values), the projections 2 * parameters a
    token, and the profile's slope says what a token costs. An estimate only: served chunks replace it."""
    points = sorted((p.tokens, p.iteration_ms) for p in profile.mixed)
    if len(points) < 2 or shape.num_parameters <= 0:
        return 0.0
    (t0, ms0), (t1, ms1) = points[0], points[-1]
    ms_per_token = max(0.0, (ms1 - ms0) / max(1, t1 - t0))
    pair_flops = 4 * shape.num_heads * shape.head_dim * shape.num_layers
    return ms_per_token * pair_flops / (2 * shape.num_parameters)
