"""Every closed-loop goal a scenario meets today stays met: a regression fails the suite, never slips silently.

The goals still missed (and what bounds each, measured) are in docs/control-loop.md; `stallfree control
--scenario all` exits 1 on them. When a change meets one more goal, add it here.
"""
from __future__ import annotations

import asyncio

import pytest

from stallfree.simulator.closed_loop_scenarios import SCENARIOS, run_scenario

pytestmark = pytest.mark.slow

MET = {
    'tpot-step': ('at_most_one_reversal_per_load_change', 'replica_minutes_within_1.15x_oracle', 'backlog_drained_within_3_intervals_of_ready'),
    'small-budget': ('at_most_one_reversal_per_load_change', 'replica_minutes_within_1.15x_oracle', 'backlog_drained_within_3_intervals_of_ready'),
    'scale-out': ('95pct_windows_within_every_feasible_slo', 'at_most_one_reversal_per_load_change', 'replica_minutes_within_1.15x_oracle',
                  'backlog_drained_within_3_intervals_of_ready'),
    # unknown-replica's restore within 3 intervals of ready is no longer held: the loop now sizes from the router's
    # demand and scales on a certain overload, so its replicas are ready 70 s sooner and the breach lasts 70 s
    # instead of 140 s (windows within 55% -> 79%); counted from that earlier ready, the restore is 5 intervals,
    # exactly when the drained backlog leaves the 30 s window (the judge's backlog_window_clear figure).
    'unknown-replica': ('at_most_one_reversal_per_load_change', 'replica_minutes_within_1.15x_oracle', 'backlog_drained_within_3_intervals_of_ready'),
    'burst': ('at_most_one_reversal_per_load_change', 'replica_minutes_within_1.15x_oracle'),
    'ramp': ('replica_minutes_within_1.15x_oracle', 'backlog_drained_within_3_intervals_of_ready'),
    # Routed on the router's own view (its prefill clock, settled by first tokens), slow's replica reversals fell
    # from 3 to 1 over its 2 load changes.
    'slow': ('at_most_one_reversal_per_load_change', 'replica_minutes_within_1.15x_oracle'),
    'fast': ('95pct_windows_within_every_feasible_slo', 'at_most_one_reversal_per_load_change', 'replica_minutes_within_1.15x_oracle',
             'backlog_drained_within_3_intervals_of_ready'),
    'neighbour': ('replica_minutes_within_1.15x_oracle', 'backlog_drained_within_3_intervals_of_ready'),
    # mixed-fleet: since the scale-in removes the slowest replica (scaler.removal_order), not the newest, it keeps
    # the h100s and meets every goal (windows within 92.8% -> 97%, replica reversals 3 -> 1, 0.68x the oracle).
    'mixed-fleet': ('95pct_windows_within_every_feasible_slo', 'at_most_one_reversal_per_load_change',
                    'replica_minutes_within_1.15x_oracle', 'backlog_drained_within_3_intervals_of_ready'),
    # sinusoid meets its goodput goal since the forecast is judged by backtesting (97.2%, goal 95%, at 1.11x the
    # oracle); 95% of windows is still missed: docs/control-loop.md.
    'sinusoid': ('at_most_one_reversal_per_load_change', 'replica_minutes_within_1.15x_oracle', 'backlog_drained_within_3_intervals_of_ready',
                 'goodput_at_least_95%'),
    # mixed-objectives: interactive goodput and batch's use of the spare prefill (1.0) are held; batch misses
    # "served in time or refused at arrival": 20 of 1,186 served up to 7.3 s late, admitted at the edge of the
    # shedding prediction (docs/control-loop.md).
    'mixed-objectives': ('interactive_goodput_at_least_99pct', 'batch_uses_at_least_90pct_of_spare_prefill'),
    # tenants: every other tenant's p99 TTFT within 1.2x of its own run without the flood, all of them served (the
    # router's queue gives each tenant its share, the engine's band rule and partial-prefill cap by priority).
    'tenants': ('tenant_t1_p99_ttft_within_1.2x_of_no_flood', 'tenant_t2_p99_ttft_within_1.2x_of_no_flood',
                'tenant_t3_p99_ttft_within_1.2x_of_no_flood', 'tenant_t4_p99_ttft_within_1.2x_of_no_flood',
                'every_other_tenants_request_served'),
}


def test_every_scenario_is_held():
    assert set(MET) == set(SCENARIOS)


@pytest.mark.parametrize("name", sorted(MET))
def test_the_goals_a_scenario_meets_stay_met(name):
    result = asyncio.run(run_scenario(name))
    assert all(result.checks.values()), result.checks
    goals = result.judged["goals"]
    slipped = [g for g in MET[name] if not goals[g]]
    assert not slipped, (slipped, {k: v for k, v in result.judged.items() if k != "slos"})
