"""The queue-wait tail the scaler sizes replicas by (operator/control/queueing.py)."""
from __future__ import annotations

import math
import random

import pytest

from stallfree.operator.control.queueing import erlang_c, replicas_for_queue_wait, wait_exceeds


def test_erlang_c_matches_its_closed_forms():
    assert erlang_c(1, 0.5) == pytest.approx(0.5)  # M/M/1: an arrival waits with probability rho
    # M/M/2 at a = 1: C = a^2 / (a^2 + (2 - a)(1 + a)) = 1/3
    assert erlang_c(2, 1.0) == pytest.approx(1 / 3)
    assert erlang_c(3, 3.0) == 1.0 and erlang_c(3, 0.0) == 0.0


def test_the_mm1_tail_is_exact():
    lam, mu, t = 0.5, 1.0, 2.0
    assert wait_exceeds(1, lam, mu, t, cv2=1.0) == pytest.approx(0.5 * math.exp(-(mu - lam) * t))
    assert wait_exceeds(1, 1.0, 1.0, t) == 1.0  # cannot keep up


def test_the_tail_agrees_with_a_simulated_mmc_queue():
    rng = random.Random(3)
    servers, lam, mu, slo = 3, 2.4, 1.0, 1.0
    free = [0.0] * servers
    t, waits = 0.0, []
    for _ in range(200_000):
        t += rng.expovariate(lam)
        k = min(range(servers), key=free.__getitem__)
        start = max(t, free[k])
        waits.append(start - t)
        free[k] = start + rng.expovariate(mu)
    simulated = sum(w > slo for w in waits) / len(waits)
    assert wait_exceeds(servers, lam, mu, slo) == pytest.approx(simulated, rel=0.1)


def test_long_prompts_need_more_replicas_than_utilisation_says():
    # 0.6 prompts/s of 1 s prefill each: 60% of one replica, but its p99 wait is past 2 s.
    assert replicas_for_queue_wait(0.6, 1.0, 2.0, cv2=0.04) == 2
    # The same demand in short prompts (1/20 s each, twenty times as many): one replica holds it.
    assert replicas_for_queue_wait(12.0, 20.0, 2.0, cv2=0.04) == 1
    # Mixed lengths (cv2 4) wait longer than uniform ones at the same mean.
    assert replicas_for_queue_wait(3.0, 1.0, 2.0, cv2=4.0) > replicas_for_queue_wait(3.0, 1.0, 2.0, cv2=0.04)
    assert replicas_for_queue_wait(0.0, 1.0, 2.0) == 0
