"""Workload generation: arrival processes, length distributions, traces, shared prefixes."""
from __future__ import annotations

import json
import random
import statistics

import pytest

from stallfree.simulator.workload import (
    SHAREGPT_OUTPUT, SHAREGPT_PROMPT, Fixed, LogNormal, Mixture, Uniform, WorkloadSpec, generate, load_trace,
    parse_length, prompt_token_ids,
)


def _gaps(requests):
    return [b.arrival_s - a.arrival_s for a, b in zip(requests, requests[1:])]


def test_poisson_arrivals_have_the_rate_and_exponential_spread():
    requests = generate(WorkloadSpec(rate=4.0, num_requests=4000, prompt=Fixed(10), output=Fixed(5), seed=1))
    gaps = _gaps(requests)
    assert requests[0].arrival_s == 0.0
    assert statistics.mean(gaps) == pytest.approx(0.25, rel=0.05)
    # Exponential gaps: coefficient of variation 1.
    assert statistics.stdev(gaps) / statistics.mean(gaps) == pytest.approx(1.0, rel=0.08)


@pytest.mark.parametrize("arrival,burstiness", [("poisson", 1.0), ("gamma", 0.5)])
def test_a_seed_keeps_its_workload_on_the_shared_arrival_generator(arrival, burstiness):
    """The draws before the switch to stallfree.arrivals: every gap first (expovariate, or gammavariate(shape,
    1 / (rate * shape))), then each request's prompt and output length."""
    spec = WorkloadSpec(arrival=arrival, rate=3.0, burstiness=burstiness, num_requests=50,
                        prompt=Uniform(10, 900), output=Uniform(1, 300), seed=5)
    rng = random.Random(5)
    gaps = [0.0] + [rng.expovariate(3.0) if burstiness == 1.0 else rng.gammavariate(burstiness, 1 / (3.0 * burstiness))
                    for _ in range(49)]
    now, expected = 0.0, []
    for gap in gaps:
        now += gap
        expected.append((now, spec.prompt.sample(rng), spec.output.sample(rng)))
    assert [(r.arrival_s, r.prompt_len, r.output_len) for r in generate(spec)] == expected


def test_gamma_burstiness_keeps_the_rate_and_raises_the_variance():
    spec = WorkloadSpec(arrival="gamma", rate=4.0, burstiness=0.25, num_requests=4000,
                        prompt=Fixed(10), output=Fixed(5), seed=2)
    gaps = _gaps(generate(spec))
    assert statistics.mean(gaps) == pytest.approx(0.25, rel=0.1)
    # Gamma with shape k: CV = 1 / sqrt(k) = 2.
    assert statistics.stdev(gaps) / statistics.mean(gaps) == pytest.approx(2.0, rel=0.15)


def test_infinite_rate_sends_everything_at_once_and_duration_cuts_arrivals():
    assert {r.arrival_s for r in generate(WorkloadSpec(rate=float("inf"), num_requests=5))} == {0.0}
    cut = generate(WorkloadSpec(rate=10.0, num_requests=1000, duration_s=5.0, seed=3))
    assert 30 < len(cut) < 80 and cut[-1].arrival_s <= 5.0


def test_length_syntax_parses_every_kind():
    assert parse_length("fixed:128") == Fixed(128)
    assert parse_length("uniform:10:20") == Uniform(10, 20)
    assert parse_length("lognormal:500:0.5:10:4000") == LogNormal(500, 0.5, 10, 4000)
    mix = parse_length("mix:0.75*fixed:100|0.25*uniform:1000:2000")
    assert isinstance(mix, Mixture) and mix.weights == (0.75, 0.25)
    assert parse_length("sharegpt-prompt") is SHAREGPT_PROMPT
    assert parse_length(mix.describe()) == mix


@pytest.mark.parametrize("bad, message", [
    ("fixed:0", "at least 1 token"),
    ("uniform:20:10", "LO <= HI"),
    ("lognormal:-3:1", "MEDIAN > 0"),
    ("gauss:1:2", "use fixed:N"),
    ("fixed:abc", "must be numbers"),
    ("mix:fixed:10", "WEIGHT\\*DIST"),
    ("mix:0*fixed:10", "not all zero"),
])
def test_bad_length_specs_name_the_problem(bad, message):
    with pytest.raises(ValueError, match=message):
        parse_length(bad)


def test_distributions_sample_what_they_say():
    rng = random.Random(0)
    samples = [Uniform(10, 20).sample(rng) for _ in range(2000)]
    assert min(samples) == 10 and max(samples) == 20
    mix = parse_length("mix:0.8*fixed:100|0.2*fixed:5000")
    share_long = sum(mix.sample(rng) == 5000 for _ in range(5000)) / 5000
    assert share_long == pytest.approx(0.2, abs=0.03)
    lognormal = [SHAREGPT_PROMPT.sample(rng) for _ in range(6000)]
    assert statistics.median(lognormal) == pytest.approx(1730, rel=0.07)
    assert sorted(lognormal)[int(0.9 * len(lognormal))] == pytest.approx(5696, rel=0.1)
    assert max(lognormal) <= 7000 and min(lognormal) >= 16
    outputs = [SHAREGPT_OUTPUT.sample(rng) for _ in range(6000)]
    assert statistics.median(outputs) == pytest.approx(415, rel=0.07)


def test_generation_is_deterministic_and_clipped_to_the_context():
    spec = WorkloadSpec(rate=2.0, num_requests=300, prompt=parse_length("uniform:100:3000"),
                        output=parse_length("uniform:10:2000"), max_total_len=2048, seed=7)
    first, again = generate(spec), generate(spec)
    assert first == again
    assert all(r.prompt_len + r.output_len <= 2048 and r.output_len >= 1 for r in first)
    assert any(r.prompt_len == 2047 for r in first)


def test_trace_files_load_in_arrival_order(tmp_path):
    jsonl = tmp_path / "trace.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in [
        {"arrival_s": 2.0, "prompt_len": 30, "output_len": 4},
        {"arrival_s": 0.5, "prompt_len": 10, "output_len": 2, "shared_prefix_len": 8},
    ]))
    requests = load_trace(jsonl)
    assert [r.arrival_s for r in requests] == [0.5, 2.0]
    assert requests[0].shared_prefix_len == 8
    csv_path = tmp_path / "trace.csv"
    csv_path.write_text("arrival_s,prompt_len,output_len\n0,5,6\n1.5,7,8\n")
    assert generate(WorkloadSpec(arrival="trace", trace_path=str(csv_path), num_requests=10))[1].prompt_len == 7
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"arrival_s": 1, "prompt_len": 3}\n')
    with pytest.raises(ValueError, match="record 1 needs"):
        load_trace(bad)
    with pytest.raises(ValueError, match="does not exist"):
        load_trace(tmp_path / "missing.jsonl")


def test_shared_prefix_is_common_and_the_rest_unique():
    spec = WorkloadSpec(rate=1.0, num_requests=50, prompt=Fixed(400), output=Fixed(4), shared_prefix_fraction=0.5)
    requests = generate(spec)
    ids = [prompt_token_ids(r, i, 0, 256) for i, r in enumerate(requests)]
    assert all(len(t) == 400 for t in ids)
    assert all(t[:200] == ids[0][:200] for t in ids)
    # No two requests share the block right after the prefix.
    assert len({tuple(t[200:216]) for t in ids}) == len(ids)
    groups = generate(WorkloadSpec(rate=1.0, num_requests=4, prompt=Fixed(64), output=Fixed(4),
                                   shared_prefix_fraction=0.5, num_prefix_groups=2))
    a, b = (prompt_token_ids(r, i, 0, 256) for i, r in enumerate(groups[:2]))
    assert a[:32] != b[:32]


@pytest.mark.parametrize("field, value, message", [
    ("rate", 0.0, "rate must be positive"),
    ("arrival", "uniform", "unknown arrival process"),
    ("shared_prefix_fraction", 1.5, "shared_prefix_fraction"),
    ("num_requests", 0, "num_requests"),
])
def test_bad_workload_specs_are_refused(field, value, message):
    spec = WorkloadSpec()
    setattr(spec, field, value)
    with pytest.raises(ValueError, match=message):
        generate(spec)
