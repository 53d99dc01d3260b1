"""contracts.Curve: the one interpolator over profile curves, its end rule; the one budget rule on top."""
from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from stallfree.contracts import Curve, Profile, ProfilePoint
from stallfree.profile_rules import budget_for_tpot

CURVE = Curve.through([(256, 14.0), (64, 5.0), (128, 8.0)])  # any order in


def test_between_points_the_line_through_them() -> None:
    assert CURVE.xs == (64, 128, 256)
    assert CURVE.at(64) == 5.0 and CURVE.at(128) == 8.0 and CURVE.at(256) == 14.0
    assert CURVE.at(96) == pytest.approx(6.5)
    assert CURVE.at(192) == pytest.approx(11.0)


def test_at_or_below_the_first_point_its_value() -> None:
    for x in (63, 32, 1, 0, -5):
        assert CURVE.at(x) == 5.0


def test_past_the_last_point_along_the_last_segment_never_below_zero() -> None:
    assert CURVE.at(512) == pytest.approx(14.0 + 6.0 / 128 * 256)  # slope of 128 -> 256
    falling = Curve.through([(1, 10.0), (2, 6.0)])
    assert falling.at(3) == pytest.approx(2.0)
    assert falling.at(10) == 0.0


def test_one_point_is_flat_below_it_and_proportional_past_it() -> None:
    single = Curve.through([(64, 4.0)])
    assert single.at(32) == 4.0 and single.at(64) == 4.0
    assert single.at(128) == pytest.approx(8.0)  # the segment from the origin: cost in proportion


def test_the_first_of_points_sharing_an_x_is_kept_and_no_point_is_refused() -> None:
    assert Curve.through([(64, 5.0), (64, 9.0), (128, 8.0)]).at(64) == 5.0
    with pytest.raises(ValueError):
        Curve.through([])


def test_largest_x_within_a_bound() -> None:
    assert CURVE.largest_x_within(11.0, 1, 4096) == 192
    assert CURVE.largest_x_within(14.0, 1, 200) == 200  # capped by hi
    assert CURVE.largest_x_within(5.0, 1, 4096) == 64  # the flat head fits up to the first point
    assert CURVE.largest_x_within(4.9, 1, 4096) is None  # nothing fits: not even below the first point
    assert CURVE.largest_x_within(100.0, 10, 9) is None  # an empty range


def test_largest_point_within_a_bound() -> None:
    assert CURVE.largest_point_within(11.0) == 128 and CURVE.largest_point_within(14.0) == 256
    assert CURVE.largest_point_within(4.9) is None


def _brute_force(curve: Curve, bound: float, lo: int, hi: int) -> int | None:
    return max((x for x in range(lo, hi + 1) if curve.at(x) <= bound), default=None)


points = st.lists(st.tuples(st.integers(1, 300), st.floats(0.0, 100.0, allow_nan=False)), min_size=1, max_size=8)


@given(points, st.floats(0.0, 120.0, allow_nan=False), st.integers(-10, 400), st.integers(-10, 400))
def test_largest_x_within_is_exact_on_any_curve(pts, bound, lo, hi) -> None:
    """Monotone or not (a noisy profile is served with too): the largest x that fits, never a guess by bisection."""
    curve = Curve.through(pts)
    assert curve.largest_x_within(bound, lo, hi) == _brute_force(curve, bound, lo, hi)


def test_a_profile_predicts_and_picks_its_budget_through_the_curve() -> None:
    profile = Profile(device="t", mixed=[ProfilePoint(64, 4, 5.0), ProfilePoint(128, 4, 8.0)],
                      decode_only=[ProfilePoint(1, 1, 2.0), ProfilePoint(4, 4, 3.0)])
    assert profile.iteration_ms_at(96) == pytest.approx(6.5) and profile.iteration_ms_at(16) == 5.0
    assert profile.decode_ms_at(2) == pytest.approx(2.0 + 1.0 / 3) and profile.decode_ms_at(8) == pytest.approx(4.0 + 1.0 / 3)
    # The budget rule takes measured points only: 6.5 ms fits 96 tokens on the line, but 64 is what was timed.
    def budget(target_ms: float, lo: int = 1, hi: int = 2048) -> int:
        return budget_for_tpot(profile, target_ms, lo=lo, hi=hi, margin=1.0)

    assert budget(6.5) == 64 and budget(8.0) == 128
    assert budget(1.0) == 64  # nothing fits: the smallest point (flat below it)
    assert budget(1.0, lo=100) == 100 and budget(99.0, hi=100) == 100
    without_decodes = Profile(device="t", mixed=profile.mixed)
    assert without_decodes.decode_ms_at(96) == without_decodes.iteration_ms_at(96)
