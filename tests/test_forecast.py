"""The arrival-rate forecast (operator/control/forecast.py): a sinusoid and a ramp are forecast within a bound
and trusted; a random walk forecasts badly and is not trusted, so the scaler stays reactive."""
from __future__ import annotations

import math
import random

import pytest

from stallfree.operator.control.forecast import ForecastState, find_period, observe

INTERVAL, HORIZON, TOKENS = 10.0, 30.0, 3000.0  # s, s, prompt tokens per request


def poisson_rate(rng: random.Random, requests_per_s: float) -> float:
    """Prompt tokens/s one interval of Poisson arrivals shows (normal approximation of the count)."""
    count = max(0.0, rng.gauss(requests_per_s * INTERVAL, math.sqrt(requests_per_s * INTERVAL)))
    return TOKENS * count / INTERVAL


def feed(rates):
    state, out = ForecastState(), []
    for i, rate in enumerate(rates):
        forecast, state = observe(state, (i + 1) * INTERVAL, rate, HORIZON, INTERVAL)
        out.append(forecast)
    return out, state


def sinusoid(t: float) -> float:  # 1x <-> 24x of 1 request/s over 10 minutes
    return 12.5 - 11.5 * math.cos(2 * math.pi * t / 600.0)


def test_a_sinusoid_is_forecast_within_bound_once_two_periods_are_seen():
    rng = random.Random(3)
    forecasts, _ = feed([poisson_rate(rng, sinusoid((i + 1) * INTERVAL)) for i in range(240)])
    late = forecasts[150:]  # from 2.5 periods on
    assert all(f.period_s is not None and abs(f.period_s - 600) <= 30 for f in late)
    # Trusted but near the troughs, where ten requests an interval make the relative error mostly Poisson noise.
    assert sum(f.trusted for f in late) >= 0.85 * len(late)
    assert sorted(f.error for f in late)[len(late) // 2] <= 0.1 and max(f.error for f in late) <= 0.35
    # The peak over the horizon, against the truth: within 20% of the true rate's peak there.
    for i, f in enumerate(late, start=150):
        t = (i + 1) * INTERVAL
        truth = TOKENS * max(sinusoid(t + k * INTERVAL) for k in range(1, 4))
        assert abs(f.rate - truth) <= 0.2 * truth + TOKENS, (t, f.rate, truth)


def test_a_ramp_is_forecast_within_bound():
    rng = random.Random(4)
    forecasts, _ = feed([poisson_rate(rng, 2.5 * 2 ** ((i + 1) * INTERVAL / 600.0)) for i in range(60)])
    late = forecasts[12:]
    assert all(f.period_s is None for f in late)  # a ramp has no period
    assert sum(f.trusted for f in late) >= 0.8 * len(late)
    for i, f in enumerate(late, start=12):
        truth = TOKENS * 2.5 * 2 ** ((i + 1 + HORIZON / INTERVAL) * INTERVAL / 600.0)
        assert abs(f.rate - truth) <= 0.25 * truth, (i, f.rate, truth)  # 25 requests an interval: noisy
    # The rise over the horizon: 3.5% of the rate for a doubling in 10 minutes. At 25 requests an interval the
    # forecast's own error is larger, so the scaler is handed no rise from it (it stays reactive, no worse).
    rises = [(f.rate - f.level) / f.level for f in late if f.trusted]
    assert 0.0 < sorted(rises)[len(rises) // 2] < 0.15
    assert all(f.usable_rise == 0.0 for f in late if f.trusted and (f.rate - f.level) < f.error * f.level)


def test_a_flat_noisy_load_hands_the_scaler_no_rise():
    for seed in range(3):
        rng = random.Random(seed)
        forecasts, _ = feed([poisson_rate(rng, 4.1) for _ in range(120)])
        assert sum(1 for f in forecasts if f.usable_rise) <= 2


def test_a_random_walk_is_not_trusted_so_sizing_stays_reactive():
    rng = random.Random(5)
    level, rates = 10.0, []
    for _ in range(180):
        level = max(1.0, level * math.exp(rng.gauss(0.0, 0.3)))
        rates.append(TOKENS * level)
    forecasts, _ = feed(rates)
    assert sum(f.trusted for f in forecasts) <= 0.15 * len(forecasts)
    assert all(f.usable_rise is None for f in forecasts if not f.trusted)


def test_too_little_history_is_no_forecast_and_bad_input_is_refused():
    forecast, state = observe(ForecastState(), 10.0, 5000.0, HORIZON, INTERVAL)
    assert forecast.rate is None and not forecast.trusted and forecast.usable_rise is None
    with pytest.raises(ValueError):
        observe(state, 20.0, float("nan"), HORIZON, INTERVAL)
    with pytest.raises(ValueError):
        observe(state, 20.0, -1.0, HORIZON, INTERVAL)


def test_state_round_trips_and_a_period_needs_two_of_them():
    _, state = feed([TOKENS * sinusoid((i + 1) * INTERVAL) for i in range(130)])
    assert ForecastState.from_dict(state.to_dict()) == state
    short = [((i + 1) * INTERVAL, sinusoid((i + 1) * INTERVAL)) for i in range(100)]  # 1.7 periods
    assert find_period(short, INTERVAL) is None


def test_a_step_is_not_trusted_while_the_trend_would_run_past_it():
    rng = random.Random(6)
    rates = [poisson_rate(rng, 4.0 if i < 20 else 28.0) for i in range(40)]
    forecasts, _ = feed(rates)
    assert sum(f.trusted for f in forecasts[:20]) >= 5  # the flat load before it is forecast well
    assert not any(f.trusted for f in forecasts[20:26])  # the step's own intervals: reactive
