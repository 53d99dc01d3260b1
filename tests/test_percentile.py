"""contracts.percentile: the one percentile (nearest rank, q a fraction) the stats window, judges and benchmarks use."""
from __future__ import annotations

import pytest

from stallfree.contracts import percentile
from stallfree.node_daemon.measure.stats_window import percentiles_ms
from stallfree.simulator.latency_summary import summarize


def test_percentile_is_nearest_rank_with_q_a_fraction() -> None:
    values = list(range(1, 101))
    assert percentile(values, 0.99) == 99 and percentile(values, 0.5) == 50 and percentile(values, 1.0) == 100
    assert percentile(values, 0.0) == 1 and percentile([7.0], 0.99) == 7.0
    assert percentile(list(range(1, 11)), 0.95) == 10  # rank ceil(9.5) = 10: a value some sample really took


def test_a_percent_is_refused_not_read_as_a_fraction() -> None:
    with pytest.raises(ValueError, match="fraction"):
        percentile(list(range(100)), 99)
    with pytest.raises(ValueError):
        percentile([], 0.5)


def test_the_stats_window_and_the_simulator_report_the_same_p99() -> None:
    samples_ms = [float(v) for v in (3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4)]
    window = percentiles_ms([v / 1000.0 for v in samples_ms])
    summary = summarize(samples_ms)
    assert window.p99 == pytest.approx(summary["p99"]) and window.p50 == pytest.approx(summary["p50"])
    assert summary["p90"] == percentile(sorted(samples_ms), 0.9) == 9.0
