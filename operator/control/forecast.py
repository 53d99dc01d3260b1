"""A forecast of the arrival rate, fitted online, so the scaler can ask for replicas before the load. Pure.

Every control step adds the prompt tokens/s that arrived over the last interval (the router's count). The
forecast is a least-squares fit over the recent history: level and trend, plus one harmonic at the period the
history's autocorrelation shows when one stands out (a daily cycle, a sinusoid); a ramp is its trend alone.

Each step's forecast for one ready-delay ahead is kept until that time comes, then judged against what
arrived: the error is the sum of |forecast - observed| over the last judged forecasts, over the sum observed
(weighted by load, so a quiet interval's Poisson noise does not decide it; each interval counts as at least a
quarter of the history's mean rate, so a trough's near-zero arrivals do not make a small miss a large one).
Until enough were judged, or while that error is over `max_error`, the forecast is not trusted and the scaler
sizes from what it measures, as it did before: a load that cannot be forecast is handled no worse than by the
reactive loop. Nor is it trusted while the fit misses the last few intervals themselves by more than
`max_error` (a step, not a trend: a line through a step would run far past it, and the judged error would say
so only after the replicas were bought).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Any, Sequence


@dataclass(frozen=True)
class ForecastConfig:
    history_s: float = 1800.0  # what the fit and the period search look back over
    trend_window_s: float = 240.0  # without a period: the trend is fitted over this recent stretch
    significance: float = 2.0  # a rise is used only when it exceeds this many of its standard errors
    min_period_s: float = 120.0
    min_correlation: float = 0.5  # a period is taken only where the detrended history repeats this well
    recent: int = 3  # the fit must hold over this many latest intervals to be trusted
    judged: int = 6  # the error is over this many recent judged forecasts ...
    min_judged: int = 3  # ... and needs at least this many before the forecast is trusted
    max_error: float = 0.25


@dataclass(frozen=True)
class ForecastState:
    """Round-trips through the loop's state (status.control.state.forecast)."""

    history: tuple[tuple[float, float], ...] = ()  # (time, arrival rate over the interval ending then)
    pending: tuple[tuple[float, float], ...] = ()  # (due time, forecast made for it)
    errors: tuple[tuple[float, float, float], ...] = ()  # (time, |forecast - observed|, observed)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> "ForecastState":
        data = data or {}
        return cls(history=tuple((float(t), float(v)) for t, v in data.get("history", ())),
                   pending=tuple((float(t), float(v)) for t, v in data.get("pending", ())),
                   errors=tuple((float(t), float(e), float(o)) for t, e, o in data.get("errors", ())))


@dataclass(frozen=True)
class Forecast:
    """This step's forecast: the largest rate expected over the next `horizon_s`, and how far to trust it."""

    rate: float | None  # prompt tokens/s (None: too little history to fit)
    horizon_s: float
    error: float | None  # recent judged relative error (None: too few judged)
    trusted: bool
    period_s: float | None  # the period found, if any
    judged: int = 0
    level: float | None = None  # the fit's rate now: `rate` less this is the rise expected over the horizon
    significant: bool = False  # the rise exceeds its standard error `significance` times over

    @property
    def usable_rise(self) -> float | None:
        """What the scaler may add to the demand it measures: a trusted forecast's rise over the horizon. The rise,
        not the level: a fit's level is as noisy as the intervals it is fitted on, its slope much less so."""
        if not self.trusted or self.rate is None or self.level is None:
            return None
        rise = max(0.0, self.rate - self.level)
        # Only a rise larger than what the forecast has been getting wrong lately: on a flat load its error is
        # the arrivals' noise, and a noise-sized rise is no reason to buy a replica.
        return rise if self.significant and rise > (self.error or 0.0) * self.level else 0.0

    def describe(self) -> str:
        if self.rate is None:
            return "no forecast yet (too little history)"
        err = "not yet judged" if self.error is None else f"error {self.error:.0%} over {self.judged} judged"
        period = f", period {self.period_s:.0f}s" if self.period_s else ""
        use = "used" if self.trusted else "not used: sizing is reactive"
        return f"forecast {self.rate:.0f} prompt tok/s within {self.horizon_s:.0f}s ({err}{period}; {use})"


def observe(state: ForecastState, now: float, rate: float, horizon_s: float, interval_s: float,
            config: ForecastConfig = ForecastConfig()) -> tuple[Forecast, ForecastState]:
    """Add the rate that arrived over the interval ending `now`; judge the forecasts due; forecast ahead.

    The rate returned is the largest forecast over the next `horizon_s` (steps of `interval_s`): replicas asked
    for now are ready about then, and must carry what comes until the next ones could be."""
    if rate < 0 or not math.isfinite(rate):
        raise ValueError(f"arrival rate must be a finite non-negative number, got {rate!r}")
    if interval_s <= 0:
        raise ValueError(f"interval must be positive, got {interval_s!r}")
    history = tuple(x for x in state.history if x[0] > now - config.history_s) + ((now, rate),)
    errors, pending = list(state.errors), []
    for due, predicted in state.pending:
        if due <= now + interval_s / 2:  # its time came: judged against this interval's arrivals
            errors.append((now, abs(predicted - rate), rate))
        else:
            pending.append((due, predicted))
    errors = errors[-config.judged:]
    steps = max(1, math.ceil(horizon_s / interval_s - 1e-9))
    times = [now + k * interval_s for k in range(1, steps + 1)]
    latest = history[-config.recent:]
    values, period, rise_se = fit_and_extrapolate(history, [t for t, _ in latest] + times, interval_s, config,
                                                  rise_from=now)
    fit_error, level = None, None
    floor = 0.25 * sum(v for _, v in history) / len(history)
    if values is not None:
        level = max(0.0, values[len(latest) - 1])  # the fit at `now` (the latest history point)
        fitted, values = values[:len(latest)], values[len(latest):]
        seen = sum(max(v, floor) for _, v in latest)
        fit_error = sum(abs(f - v) for f, (_, v) in zip(fitted, latest)) / seen if seen > 0 else None
    if values is not None:
        pending.append((times[-1], max(0.0, values[-1])))  # judged one ready-delay from now
    observed = sum(max(o, floor) for _, _, o in errors)
    error = None if len(errors) < config.min_judged else (
        sum(e for _, e, _ in errors) / observed if observed > 0 else (0.0 if not any(e for _, e, _ in errors)
                                                                      else math.inf))
    peak = None if values is None else max(0.0, max(values))
    trusted = peak is not None and error is not None and error <= config.max_error \
        and fit_error is not None and fit_error <= config.max_error
    # A rise within the fit's own noise (a Poisson burst on a flat load fitted as a trend) is no rise.
    significant = values is not None and level is not None and rise_se is not None \
        and values[-1] - level > config.significance * rise_se
    new_state = replace(state, history=history, pending=tuple(pending), errors=tuple(errors))
    return Forecast(peak, horizon_s, error, trusted, period, len(errors), level, significant), new_state


def fit_and_extrapolate(history: Sequence[tuple[float, float]], times: Sequence[float], interval_s: float,
                        config: ForecastConfig = ForecastConfig(), rise_from: float | None = None
                        ) -> tuple[list[float] | None, float | None, float | None]:
    """The fitted rate at each of `times`, the period used (None: trend only), and the standard error of the fit's
    rise from `rise_from` to the last of `times` (from the residuals). None with too little history."""
    if len(history) < 4:
        return None, None, None
    period = find_period(history, interval_s, config)
    if period is not None:
        window = [x for x in history if x[0] > history[-1][0] - 2 * period]
        basis = _harmonic(period)
    else:
        window = [x for x in history if x[0] > history[-1][0] - config.trend_window_s]
        basis = _linear
    if len(window) < 4:
        return None, None, None
    origin = window[-1][0]
    rows, y = [basis(t - origin) for t, _ in window], [v for _, v in window]
    gram = [[sum(r[i] * r[j] for r in rows) for j in range(len(rows[0]))] for i in range(len(rows[0]))]
    coef = _solve(gram, [sum(r[i] * v for r, v in zip(rows, y)) for i in range(len(rows[0]))])
    if coef is None:
        return None, None, None
    rise_se = None
    if rise_from is not None and len(window) > len(coef):
        # Var(fit(b) - fit(a)) = sigma^2 d' (X'X)^-1 d, d = basis(b) - basis(a)
        sigma2 = sum((v - sum(c * b for c, b in zip(coef, r))) ** 2 for r, v in zip(rows, y)) / (len(window) - len(coef))
        d = [b - a for a, b in zip(basis(rise_from - origin), basis(times[-1] - origin))]
        z = _solve(gram, d)
        rise_se = None if z is None else math.sqrt(max(0.0, sigma2 * sum(x * w for x, w in zip(d, z))))
    return [sum(c * b for c, b in zip(coef, basis(t - origin))) for t in times], period, rise_se


def find_period(history: Sequence[tuple[float, float]], interval_s: float,
                config: ForecastConfig = ForecastConfig()) -> float | None:
    """The lag (seconds) at which the detrended history correlates best with itself, past its first dip below
    zero, if that correlation reaches `min_correlation` and the history holds two such periods; else None."""
    values = [v for _, v in history]
    n = len(values)
    min_lag = max(2, int(config.min_period_s / interval_s))
    if n < 3 * min_lag:
        return None
    coef = _least_squares([_linear(float(i)) for i in range(n)], values)
    if coef is None:
        return None
    resid = [v - (coef[0] + coef[1] * i) for i, v in enumerate(values)]
    var = sum(r * r for r in resid)
    if var <= 0:
        return None
    best_lag, best, dipped = None, config.min_correlation, False
    for lag in range(1, n // 2 + 1):
        r = sum(resid[i] * resid[i + lag] for i in range(n - lag)) / var * n / (n - lag)
        dipped = dipped or r < 0
        if dipped and lag >= min_lag and r > best:
            best_lag, best = lag, r
    return None if best_lag is None else best_lag * interval_s


def _linear(t: float) -> list[float]:
    return [1.0, t]


def _harmonic(period: float):
    w = 2 * math.pi / period

    def basis(t: float) -> list[float]:
        return [1.0, t, math.sin(w * t), math.cos(w * t)]
    return basis


def _least_squares(rows: list[list[float]], y: list[float]) -> list[float] | None:
    """Coefficients minimising |rows . c - y|^2 (normal equations); None if singular."""
    k = len(rows[0])
    return _solve([[sum(r[i] * r[j] for r in rows) for j in range(k)] for i in range(k)],
                  [sum(r[i] * v for r, v in zip(rows, y)) for i in range(k)])


def _solve(matrix: list[list[float]], rhs: list[float]) -> list[float] | None:
    """x with matrix . x = rhs (Gaussian elimination, partial pivoting); None if singular."""
    k = len(rhs)
    a = [list(row) + [b] for row, b in zip(matrix, rhs)]
    for col in range(k):
        pivot = max(range(col, k), key=lambda r: abs(a[r][col]))
        if abs(a[pivot][col]) < 1e-12:
            return None
        a[col], a[pivot] = a[pivot], a[col]
        for r in range(k):
            if r != col:
                f = a[r][col] / a[col][col]
                a[r] = [x - f * p for x, p in zip(a[r], a[col])]
    return [a[i][k] / a[i][i] for i in range(k)]

