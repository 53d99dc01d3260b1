"""A CPU daemon told neither --token-budget nor --tpot-slo-ms starts at CPU_TOKEN_BUDGET, within the ceiling and
never below the prefill room its running decodes need."""
from __future__ import annotations

from stallfree.contracts import Ceilings, Tuning, min_budget_for, validate_tuning
from stallfree.node_daemon.daemon import CPU_TOKEN_BUDGET, cpu_starting_tuning


def test_the_cpu_budget_replaces_the_general_default_and_keeps_the_other_knobs():
    tuning = Tuning(token_budget=512, max_num_seqs=64, max_partial_prefills=2)
    started = cpu_starting_tuning(tuning, Ceilings())
    assert started.token_budget == CPU_TOKEN_BUDGET != tuning.token_budget
    assert (started.max_num_seqs, started.max_partial_prefills) == (64, 2)
    validate_tuning(started, Ceilings())


def test_it_leaves_room_for_every_decode_and_stays_under_the_ceiling():
    many = cpu_starting_tuning(Tuning(max_num_seqs=256), Ceilings())
    assert many.token_budget == min_budget_for(256) > CPU_TOKEN_BUDGET
    assert cpu_starting_tuning(Tuning(max_num_seqs=16), Ceilings(max_token_budget=128)).token_budget == 128
