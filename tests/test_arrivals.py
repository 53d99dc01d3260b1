"""The one arrival generator: its rate, its bounds and its seed."""
import math
import random

import pytest

from stallfree.arrivals import arrival_times, next_gap


def test_poisson_arrivals_keep_their_rate_and_window():
    times = list(arrival_times(5.0, random.Random(1), start=10.0, end=1010.0))
    assert all(10.0 < t < 1010.0 for t in times)
    assert times == sorted(times)
    assert len(times) / 1000.0 == pytest.approx(5.0, rel=0.05)


def test_count_and_first_at_start():
    times = list(arrival_times(2.0, random.Random(3), count=4, first_at_start=True))
    assert len(times) == 4 and times[0] == 0.0 and times[1] > 0.0


def test_a_seed_gives_the_same_arrivals_as_one_expovariate_per_gap():
    rng = random.Random(7)
    expected, t = [], 0.0
    for _ in range(5):
        t += rng.expovariate(3.0)
        expected.append(t)
    assert list(arrival_times(3.0, random.Random(7), count=5)) == expected


def test_bursty_gaps_keep_the_mean_but_spread_more():
    rng = random.Random(11)
    poisson = [next_gap(4.0, rng) for _ in range(20000)]
    bursty = [next_gap(4.0, rng, burstiness=0.25) for _ in range(20000)]
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    var = lambda xs: sum((x - mean(xs)) ** 2 for x in xs) / len(xs)  # noqa: E731
    assert mean(bursty) == pytest.approx(0.25, rel=0.1) and mean(poisson) == pytest.approx(0.25, rel=0.05)
    assert var(bursty) > 2 * var(poisson)


def test_bad_rates_are_refused_and_zero_never_arrives():
    assert next_gap(0.0, random.Random(0)) == math.inf
    assert list(arrival_times(0.0, random.Random(0), end=100.0)) == []
    with pytest.raises(ValueError):
        next_gap(-1.0, random.Random(0))
    with pytest.raises(ValueError):
        list(arrival_times(1.0, random.Random(0)))
