"""The benchmarks draw their arrivals from stallfree.arrivals, and a seed still gives the arrivals it gave before."""
from __future__ import annotations

import random

from stallfree.bench.engine_serving import arrival_offsets
from stallfree.bench.router import affinity_workload


def test_affinity_workload_keeps_its_seeds_sequence():
    def before(rate, duration_s, seed, groups=48, prefix_tokens=2048):  # bench router's own generator
        rng = random.Random(seed)
        now, out = 0.0, []
        while True:
            now += rng.expovariate(rate) if out else 0.0
            if now > duration_s:
                return out
            suffix = rng.randint(32, 256)
            out.append((now, prefix_tokens + suffix, rng.randint(16, 48), rng.randrange(groups)))

    new = [(r.arrival_s, r.prompt_len, r.output_len, r.prefix_group) for r in affinity_workload(3.0, 60.0, 11)]
    assert new == before(3.0, 60.0, 11) and len(new) > 100


def test_serving_row_offsets_keep_their_seeds_sequence():
    rng, t, before = random.Random(7), 0.0, []
    for _ in range(50):
        before.append(t)
        t += rng.expovariate(2.0)
    assert arrival_offsets(50, 2.0, seed=7) == before
