"""A forecast of the arrival rate, fitted online, so the scaler can ask for replicas before the load. Pure.

Every control step adds the prompt tokens/s that arrived over the last interval (the router's count). The
forecast is a least-squares fit over the recent history, one of several models: level and trend over a short,
a middle or a long stretch (a sinusoid's rise wants the short one, a slow ramp the long one, whose slope the
arrivals' noise moves least), or, when the history's autocorrelation shows a period (a daily cycle, a
sinusoid) and holds two of them, level, trend and one harmonic at that period.

Each model is judged by backtesting: at each of the last `backtests` intervals it is refitted on the history up
to one ready-delay before, and its forecast for that interval is compared with what arrived. The error is the
sum of |forecast - observed| over the sum observed (weighted by load, so a quiet interval's Poisson noise does
not decide it; each interval counts as at least a quarter of the history's mean rate, so a trough's near-zero
arrivals do not make a small miss a large one). The model with the smallest error forecasts. So the error is the
one of the model forecasting now, over the latest intervals, not of forecasts made a ready-delay ago by whatever
fitted then; and a load that changes its shape changes the model.

Trusted only while that error is within `max_error` and the fit holds over the last few intervals themselves (a
step, not a trend: a line through a step would run far past it). Untrusted, the scaler sizes from what it
measures, as it did before: a load that cannot be forecast is handled no worse than by the reactive loop. A
trusted forecast's rise is handed to the scaler only when it is significant: more than `significance` standard
errors of the fitted rise (from the fit's own residuals), from a model that backtested better than the measured
rate held (the mean of the latest intervals: what reactive sizing goes by). On a flat load the rise is noise and
rarely passes; on a random walk the held rate forecasts as well as any trend; on a ramp the slope, fitted over a
longer stretch, passes though each interval's noise is larger than the rise.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Callable, Sequence

Basis = Callable[[float], list[float]]


@dataclass(frozen=True)
class ForecastConfig:
    history_s: float = 1800.0  # what the fits and the period search look back over
    trend_windows_s: tuple[float, ...] = (120.0, 240.0, 480.0)  # the trend models' stretches
    significance: float = 3.0  # a rise is used only when it exceeds this many of its standard errors
    min_period_s: float = 120.0
    min_correlation: float = 0.5  # a period is taken only where the detrended history repeats this well
    recent: int = 3  # the fit must hold over this many latest intervals to be trusted
    backtests: int = 8  # each model's error is over its forecasts for this many latest intervals ...
    min_backtests: int = 3  # ... and needs at least this many before the forecast is trusted
    max_error: float = 0.25


@dataclass(frozen=True)
class ForecastState:
    """Round-trips through the loop's state (status.control.state.forecast)."""

    history: tuple[tuple[float, float], ...] = ()  # (time, arrival rate over the interval ending then)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> "ForecastState":
        data = data or {}  # (a state written before backtesting also holds pending forecasts: not needed now)
        return cls(history=tuple((float(t), float(v)) for t, v in data.get("history", ())))


@dataclass(frozen=True)
class Forecast:
    """This step's forecast: the largest rate expected over the next `horizon_s`, and how far to trust it."""

    rate: float | None  # prompt tokens/s (None: too little history to fit)
    horizon_s: float
    error: float | None  # the chosen model's backtested relative error (None: too few backtests)
    trusted: bool
    period_s: float | None  # the period the history shows, if any
    judged: int = 0  # backtests behind `error`
    level: float | None = None  # the fit's rate now: `rate` less this is the rise expected over the horizon
    # The rise exceeds its standard error `significance` times over, and the model backtested better than the
    # measured rate held (what reactive sizing goes by).
    significant: bool = False
    model: str = ""  # which model forecasts ("trend 240s", "period 600s")

    @property
    def usable_rise(self) -> float | None:
        """What the forecast adds to the level it fits now: a trusted forecast's significant rise (0 when it is
        not significant: a noise-sized rise is no reason to buy a replica); None when not trusted."""
        if not self.trusted or self.rate is None or self.level is None:
            return None
        return max(0.0, self.rate - self.level) if self.significant else 0.0

    @property
    def usable_rate(self) -> float | None:
        """The demand to have replicas for one ready-delay ahead, when a trusted forecast sees a significant rise
        (None otherwise: size from what is measured). The fit's rate, not the measured rate plus the rise: the
        fit lags the load less than a stats window does and is less noisy than one interval's count."""
        return self.rate if self.usable_rise else None

    def describe(self) -> str:
        if self.rate is None:
            return "no forecast yet (too little history)"
        err = "not yet backtested" if self.error is None else f"error {self.error:.0%} over {self.judged} backtests"
        use = "used" if self.usable_rate is not None else (
            "no significant rise" if self.trusted else "not used: sizing is reactive")
        return f"forecast {self.rate:.0f} prompt tok/s within {self.horizon_s:.0f}s ({self.model}, {err}; {use})"


@dataclass(frozen=True)
class _Model:
    name: str
    basis: Basis
    stretch_s: float  # fitted over the history within this much of the forecast's origin


@dataclass(frozen=True)
class _Fit:
    coef: list[float]
    basis: Basis
    origin: float
    gram: list[list[float]]
    sigma2: float  # the residuals' variance

    def at(self, t: float) -> float:
        return sum(c * b for c, b in zip(self.coef, self.basis(t - self.origin)))

    def rise_se(self, a: float, b: float) -> float | None:
        """Standard error of at(b) - at(a): sigma^2 d' (X'X)^-1 d, d = basis(b) - basis(a)."""
        d = [y - x for x, y in zip(self.basis(a - self.origin), self.basis(b - self.origin))]
        z = _solve(self.gram, d)
        return None if z is None else math.sqrt(max(0.0, self.sigma2 * sum(x * w for x, w in zip(d, z))))


def observe(state: ForecastState, now: float, rate: float, horizon_s: float, interval_s: float,
            config: ForecastConfig = ForecastConfig()) -> tuple[Forecast, ForecastState]:
    """Add the rate that arrived over the interval ending `now`; backtest the models; forecast ahead.

    The rate returned is the largest forecast over the next `horizon_s` (steps of `interval_s`): replicas asked
    for now are ready about then, and must carry what comes until the next ones could be."""
    if rate < 0 or not math.isfinite(rate):
        raise ValueError(f"arrival rate must be a finite non-negative number, got {rate!r}")
    if interval_s <= 0:
        raise ValueError(f"interval must be positive, got {interval_s!r}")
    history = tuple(x for x in state.history if x[0] > now - config.history_s) + ((now, rate),)
    new_state = ForecastState(history=history)
    steps = max(1, math.ceil(horizon_s / interval_s - 1e-9))
    lead = steps * interval_s  # a forecast made now is judged `lead` from now
    floor = 0.25 * sum(v for _, v in history) / len(history)
    period = find_period(history, interval_s, config)
    judged = [(m, *backtest(history, model_forecast(history, m), lead, floor, config))
              for m in models(period, config)]
    judged = [j for j in judged if j[2] >= config.min_backtests]
    if judged:
        model, error, count = min(judged, key=lambda j: j[1])
    else:  # too little history to judge any model: the middle stretch's trend, not trusted
        model, error, count = models(None, config)[len(config.trend_windows_s) // 2], None, 0
    fit = fit_model(history, model, now)
    if fit is None:
        return Forecast(None, horizon_s, error, False, period, count, model=model.name), new_state
    ahead = [fit.at(now + k * interval_s) for k in range(1, steps + 1)]
    level = max(0.0, fit.at(now))
    latest = history[-config.recent:]
    seen = sum(max(v, floor) for _, v in latest)
    fit_error = sum(abs(fit.at(t) - v) for t, v in latest) / seen if seen > 0 else None
    trusted = error is not None and error <= config.max_error and fit_error is not None \
        and fit_error <= config.max_error
    # A rise within the fit's own noise (a Poisson burst on a flat load fitted as a trend) is no rise; nor is
    # one from a model that forecast no better than the measured rate held (a random walk's last stretch).
    held_error, held_count = backtest(history, held_forecast(history, config.recent), lead, floor, config)
    rise_se = fit.rise_se(now, now + lead)
    significant = rise_se is not None and ahead[-1] - level > config.significance * rise_se \
        and error is not None and held_count >= config.min_backtests and error < held_error
    return Forecast(max(0.0, max(ahead)), horizon_s, error, trusted, period, count, level, significant,
                    model.name), new_state


def models(period: float | None, config: ForecastConfig = ForecastConfig()) -> list[_Model]:
    """The candidate models: a trend over each stretch, and a harmonic at the period, if the history shows one."""
    out = [_Model(f"trend {w:.0f}s", _linear, w) for w in config.trend_windows_s]
    if period is not None:
        out.append(_Model(f"period {period:.0f}s", _harmonic(period), 2 * period))
    return out


def backtest(history: Sequence[tuple[float, float]], predict: Callable[[float, float], float | None], lead_s: float,
             floor: float, config: ForecastConfig = ForecastConfig()) -> tuple[float | None, int]:
    """The relative error of `predict(origin, t)` (the rate at t from the history up to origin) over the latest
    intervals, each forecast from `lead_s` before it; and how many could be forecast (error None: none)."""
    errors, observed = 0.0, 0.0
    count = 0
    for t, v in history[-config.backtests:]:
        forecast = predict(t - lead_s, t)
        if forecast is None:
            continue
        errors += abs(max(0.0, forecast) - v)
        observed += max(v, floor)
        count += 1
    if not count:
        return None, 0
    return (errors / observed if observed > 0 else (0.0 if errors == 0 else math.inf)), count


def model_forecast(history: Sequence[tuple[float, float]], model: _Model) -> Callable[[float, float], float | None]:
    """The model refitted on the history up to each origin, as `backtest` asks for it."""
    def predict(origin: float, t: float) -> float | None:
        fit = fit_model(history, model, origin)
        return None if fit is None else fit.at(t)
    return predict


def held_forecast(history: Sequence[tuple[float, float]], intervals: int) -> Callable[[float, float], float | None]:
    """The mean of the `intervals` latest rates at the origin, held: what sizing from the measured rate forecasts."""
    def predict(origin: float, t: float) -> float | None:
        latest = [v for u, v in history if u <= origin + 1e-6][-intervals:]
        return sum(latest) / len(latest) if len(latest) == intervals else None
    return predict


def fit_model(history: Sequence[tuple[float, float]], model: _Model, origin: float) -> _Fit | None:
    """The model fitted on the history up to `origin` (within its stretch); None with too little of it."""
    window = [x for x in history if origin - model.stretch_s < x[0] <= origin + 1e-6]
    k = len(model.basis(0.0))
    if len(window) < max(4, k + 1):
        return None
    rows, y = [model.basis(t - origin) for t, _ in window], [v for _, v in window]
    gram = [[sum(r[i] * r[j] for r in rows) for j in range(k)] for i in range(k)]
    coef = _solve(gram, [sum(r[i] * v for r, v in zip(rows, y)) for i in range(k)])
    if coef is None:
        return None
    sigma2 = sum((v - sum(c * b for c, b in zip(coef, r))) ** 2 for r, v in zip(rows, y)) / (len(window) - k)
    return _Fit(coef, model.basis, origin, gram, sigma2)


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


def _harmonic(period: float) -> Basis:
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
