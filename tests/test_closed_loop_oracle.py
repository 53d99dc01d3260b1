"""The oracle routes a phase's arrivals as the cluster does and finds the fewest replicas meeting every SLO."""
from __future__ import annotations

import pytest

from stallfree.simulator.closed_loop_judge import WINDOW_FRACTION
from stallfree.simulator.closed_loop_oracle import _budgets, _steady, fewest_replicas
from stallfree.simulator.closed_loop_scenarios import scale_out


@pytest.mark.slow
def test_oracle_count_is_the_fewest_that_meets_every_slo_under_the_clusters_routing():
    scenario = scale_out()
    high = scenario.phases[1]
    n, budget, fractions = fewest_replicas(scenario, high)
    assert min(fractions.values()) >= WINDOW_FRACTION
    # One replica fewer misses some SLO at every candidate budget: n is the least, not merely enough.
    prompt, output = high.prompt_len.describe(), high.output_len.describe()
    for b in _budgets(scenario):
        assert min(_steady(scenario, high.rate, n - 1, prompt, output, b).values()) < WINDOW_FRACTION
    # Routed by least outstanding requests, n stays near demand over one replica's capacity (about 3 here):
    # an even Poisson split per replica needed 8 of the 8 allowed.
    assert n <= 5
