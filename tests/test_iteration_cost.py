"""The online iteration-cost model: the profile as measured until served iterations say otherwise, then the
context terms and the machine's speed fitted from them; the scheduler cuts chunks over a long prefix to it."""
from __future__ import annotations

import pytest

from scheduler_driver import checked_step, make_request, make_scheduler
from stallfree.contracts import Profile, ProfilePoint
from stallfree.node_daemon.engine.iteration_cost import FORGET, MIN_CHUNK, OnlineIterationCost, prior_per_prefix_pair


def _profile() -> Profile:
    # 20 ms fixed plus 0.5 ms a token; decodes alone 20 ms plus 1 ms each.
    mixed = [ProfilePoint(tokens=t, num_decodes=4, iteration_ms=20 + 0.5 * t) for t in (64, 128, 256, 512)]
    decode = [ProfilePoint(tokens=b, num_decodes=b, iteration_ms=20 + 1.0 * b) for b in (1, 4, 16)]
    return Profile(device="cpu", decode_only=decode, mixed=mixed)


def _machine(decode_lens, chunks, speed=1.0, per_pair=2e-4, per_context=0.0) -> float:
    """The 'real' iteration: the profile's time scaled, plus attention to the cached prefix."""
    base = OnlineIterationCost(_profile()).base_ms(decode_lens, chunks)
    return speed * base + per_pair * sum(p * n for p, n in chunks) + per_context * sum(decode_lens)


def test_before_any_iteration_it_predicts_the_profile():
    model = OnlineIterationCost(_profile())
    assert model.predict_ms([10] * 4, [(1000, 124)]) == pytest.approx(20 + 0.5 * 128)
    assert model.predict_ms([10] * 4, []) == pytest.approx(24.0)


def test_it_learns_the_cost_of_a_long_prefix_from_served_chunks():
    model = OnlineIterationCost(_profile())
    decodes = [40, 41, 42, 43]
    for prefix in range(0, 1500, 125):  # a long prompt prefilled 125 tokens at a time beside 4 decodes
        chunks = [(prefix, 125)]
        model.observe(decodes, chunks, _machine(decodes, chunks))
    late = [(1400, 125)]
    assert model.predict_ms(decodes, late) == pytest.approx(_machine(decodes, late), rel=0.1)
    assert model.predict_ms(decodes, late) > 1.25 * model.base_ms(decodes, late)  # truly 1.41x


def test_a_slower_machine_is_learned_from_decodes_alone():
    model = OnlineIterationCost(_profile())
    for step in range(60):
        decodes = [50 + step] * (1 + step % 8)
        model.observe(decodes, [], _machine(decodes, [], speed=2.0, per_pair=0.0))
    decodes = [120] * 6
    assert model.predict_ms(decodes, []) == pytest.approx(_machine(decodes, [], speed=2.0), rel=0.1)
    assert model.coefficients[1] == 0.0  # no chunk has run: the prefix term keeps its prior


def test_one_odd_iteration_does_not_swing_the_fit():
    model = OnlineIterationCost(_profile())
    decodes = [100] * 4
    for _ in range(30):
        model.observe(decodes, [], _machine(decodes, []))
    model.observe(decodes, [], 10_000.0)  # a pause (swap, a stopped process)
    assert model.coefficients[0] <= 4.0
    assert model.predict_ms(decodes, []) < 5 * 24.0


def test_the_scheduler_cuts_chunks_over_a_long_prefix_to_the_budgets_time():
    model = OnlineIterationCost(_profile())
    model.coefficients = (1.0, 2e-4, 0.0)  # as fitted from served iterations
    scheduler = make_scheduler(num_blocks=200, block_size=16, token_budget=256, max_model_len=4096)
    scheduler.set_prefix_cost(model)
    scheduler.add_request(make_request("long", 1500, max_tokens=2))
    budget_ms = 20 + 0.5 * 256
    sizes = []
    while True:
        output, _ = checked_step(scheduler)
        chunks = [(c.start, c.num_tokens) for c in output.chunks if c.is_prefill]
        if not chunks:
            break
        assert model.predict_ms([], chunks) <= budget_ms + 1e-9
        sizes.append(chunks[0][1])
    assert sum(sizes) == 1500
    assert sizes[0] == 256  # over no prefix the budget is the budget
    assert sizes[-2] < 0.8 * sizes[0]  # over a long prefix the same time takes fewer tokens
    assert min(sizes[:-1]) >= MIN_CHUNK


def test_a_machine_that_is_only_slower_cuts_no_chunk():
    model = OnlineIterationCost(_profile())
    model.coefficients = (2.0, 0.0, 0.0)
    assert model.chunk_within_budget(200, 56, 1000, 256) == 200
    model.coefficients = (2.0, 4e-4, 0.0)  # the prefix costs what 2e-4 would on the profiled machine
    slow = model.chunk_within_budget(200, 56, 1000, 256)
    model.coefficients = (1.0, 2e-4, 0.0)
    assert slow == model.chunk_within_budget(200, 56, 1000, 256) < 200


def test_the_engine_feeds_every_served_iteration_to_the_model():
    from test_engine import make_engine, run_all

    from stallfree.node_daemon.engine.sampling_params import SamplingParams

    engine = make_engine(budget=64)
    model = OnlineIterationCost(_profile())
    engine.scheduler.set_prefix_cost(model)
    engine.add_request("long", prompt_token_ids=list(range(10, 210)),
                       sampling=SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    run_all(engine)
    # 200 prompt tokens in 64-token chunks, then decodes: every iteration folded in, none twice.
    assert engine.num_iterations >= 6
    assert model._weight == pytest.approx(sum(FORGET ** k for k in range(engine.num_iterations)))
    assert model.coefficients != (1.0, 0.0, 0.0)  # the fit moved off its prior


def test_a_tpot_target_caps_chunks_over_a_prefix_at_the_machines_speed():
    free = OnlineIterationCost(_profile())
    held = OnlineIterationCost(_profile(), iteration_target_ms=100.0)
    for model in (free, held):
        model.coefficients = (1.5, 2e-4, 0.0)  # a machine half again slower than profiled
    # Budget 256 means 148 ms profiled; 100 ms observed is 66.7 ms profiled at speed 1.5.
    assert held.chunk_within_budget(250, 6, 1000, 256) < free.chunk_within_budget(250, 6, 1000, 256)
    n = held.chunk_within_budget(250, 6, 1000, 256)
    assert 1.5 * (20 + 0.5 * (6 + n)) + 2e-4 * 1000 * n <= 100.0 + 1e-9
    assert held.chunk_within_budget(250, 6, 0, 256) == 250  # over no prefix: the budget's business
    with pytest.raises(ValueError, match="positive"):
        OnlineIterationCost(_profile(), iteration_target_ms=0.0)


def test_the_prefix_prior_comes_from_the_shape_and_cuts_a_first_long_prompt():
    from stallfree.shapes import get_shape

    shape = get_shape("smollm2-135m")
    prior = prior_per_prefix_pair(_profile(), shape)
    # 0.5 ms a token; attention 4 * 9 * 64 * 30 FLOPs a pair against 2 * ~135M a token.
    assert prior == pytest.approx(0.5 * 4 * 9 * 64 * 30 / (2 * shape.num_parameters))
    model = OnlineIterationCost(_profile(), prior_ms_per_prefix_pair=prior)
    first = model.chunk_within_budget(250, 6, 1500, 256)
    assert first < 250  # nothing served yet, and still cut
    for step in range(40):  # served chunks over prefixes of every length show the prefix costs nothing here
        chunks = [(step * 40, 128)]
        model.observe([30] * 4, chunks, _machine([30] * 4, chunks, per_pair=0.0))
    assert model.coefficients[1] < 0.5 * prior
    assert model.chunk_within_budget(250, 6, 1500, 256) > first
