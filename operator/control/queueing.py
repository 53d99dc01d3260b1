"""How many replicas keep p99 queue wait within its SLO at a demand: a multi-server queue's tail. Pure.

Utilisation alone cannot say it: the same 60% that is ample for 200-token prompts breaches a 2 s SLO when
each prompt takes a second to prefill. The router's queue feeds c replicas in arrival order, each
prefilling one prompt at a time at its capacity, so the wait is an M/G/c queue's: Poisson arrivals at
`lam` requests/s, mean service `1/mu` (mean prompt over one replica's prefill tokens/s) with squared
coefficient of variation `cv2` (of the prompt lengths), and

    P(wait > t) ~= ErlangC(c, lam/mu) * exp(-(c*mu - lam) * t * 2 / (1 + cv2))

Erlang C is the chance a request waits at all; the tail is M/M/c's with its decay scaled by the
heavy-traffic factor 2/(1 + cv2) (Kingman): exact for exponential service (cv2 = 1), steeper for prompts
of similar length, flatter for mixed lengths.
"""
from __future__ import annotations

import math

MAX_REPLICAS_SEARCHED = 4096
# Fewer arrivals than this say little about the spread of prompt lengths.
MIN_REQUESTS_FOR_SPREAD = 10


def prompt_cv2(count: int, tokens: float, squares: float) -> float | None:
    """Squared coefficient of variation of `count` prompt lengths from their sum and sum of squares (None when
    too few arrived to tell)."""
    if count < MIN_REQUESTS_FOR_SPREAD or tokens <= 0:
        return None
    mean = tokens / count
    return max(0.0, squares / count - mean * mean) / (mean * mean)


def erlang_c(servers: int, offered: float) -> float:
    """The chance an arrival waits, with `offered` = lam/mu Erlangs on `servers` (1 when overloaded)."""
    if offered <= 0:
        return 0.0
    if offered >= servers:
        return 1.0
    blocking = 1.0  # Erlang B by its stable recursion, then C from B
    for k in range(1, servers + 1):
        blocking = offered * blocking / (k + offered * blocking)
    rho = offered / servers
    return blocking / (1.0 - rho * (1.0 - blocking))


def wait_exceeds(servers: int, lam: float, mu: float, wait_s: float, cv2: float = 1.0) -> float:
    """P(queue wait > wait_s) for `servers` replicas; 1 when they cannot keep up."""
    if lam <= 0:
        return 0.0
    if mu <= 0 or lam >= servers * mu:
        return 1.0
    decay = (servers * mu - lam) * 2.0 / (1.0 + max(0.0, cv2))
    return erlang_c(servers, lam / mu) * math.exp(-decay * max(0.0, wait_s))


def replicas_for_queue_wait(lam: float, mu: float, wait_slo_s: float, cv2: float = 1.0,
                            quantile: float = 0.99) -> int:
    """The fewest replicas whose queue wait stays within `wait_slo_s` at `quantile` (0 without demand)."""
    if lam <= 0:
        return 0
    if mu <= 0:
        raise ValueError("a replica's service rate must be positive")
    servers = max(1, math.floor(lam / mu) + 1)
    while wait_exceeds(servers, lam, mu, wait_slo_s, cv2) > 1.0 - quantile and servers < MAX_REPLICAS_SEARCHED:
        servers += 1
    return servers
