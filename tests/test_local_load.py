"""The local demo's load: its arrivals are stallfree.arrivals' for the seed, at their scheduled times, phase after
phase; a stop ends it at once."""
from __future__ import annotations

import asyncio
import random
import time

from stallfree.arrivals import arrival_times
from stallfree.loadgen.prompts import PromptBuilder
from stallfree.operator.local import load as load_module
from stallfree.operator.local.load import LoadDriver, LoadPhase


def _driver(monkeypatch, seed: int = 5) -> tuple[LoadDriver, list[float]]:
    sent: list[float] = []

    async def fake_send(client, url, body, result, endpoint):
        sent.append(time.time())
        result.ok = True

    monkeypatch.setattr(load_module, "send_request", fake_send)
    return LoadDriver(lambda: ["http://replica"], "m", PromptBuilder(chars_per_token=1.0), seed=seed), sent


def test_arrivals_are_the_seeds_and_each_phase_lasts_its_duration(monkeypatch):
    driver, sent = _driver(monkeypatch)
    phases = [LoadPhase("busy", 0.6, 40.0, 8, 2), LoadPhase("idle", 0.3, 0.0, 8, 2), LoadPhase("tail", 0.3, 20.0, 8, 2)]
    started = time.time()
    asyncio.run(driver.run(phases, started=started))
    took = time.time() - started

    rng = random.Random(5)
    expected = list(arrival_times(40.0, rng, end=0.6)) + list(arrival_times(0.0, rng, end=0.3))
    expected_tail = list(arrival_times(20.0, rng, end=0.3))
    labels = [r.phase for r in driver.results]
    assert labels == ["busy"] * len(expected) + ["tail"] * len(expected_tail)
    assert took >= 1.2  # the idle phase and the last phase's quiet end are waited out
    starts = [t for t, _ in driver.phase_starts]
    assert abs(starts[1] - starts[0] - 0.6) < 0.05 and abs(starts[2] - starts[1] - 0.3) < 0.05
    offsets = [t - started - starts[0] for t in sent[:len(expected)]]
    assert all(abs(o - e) < 0.05 for o, e in zip(offsets, expected))  # scheduled times, not drifting sleeps


def test_a_stop_ends_the_load_at_once(monkeypatch):
    driver, sent = _driver(monkeypatch)

    async def main() -> float:
        stop = asyncio.Event()
        asyncio.get_running_loop().call_later(0.2, stop.set)
        begun = time.monotonic()
        await driver.run([LoadPhase("quiet", 30.0, 0.0, 8, 2), LoadPhase("never", 30.0, 50.0, 8, 2)],
                         started=time.time(), stop=stop)
        return time.monotonic() - begun

    assert asyncio.run(main()) < 2.0 and sent == [] and [p.label for _, p in driver.phase_starts] == ["quiet"]
