"""Load for the local runtime: Poisson phases of real streaming requests, routed like a Service would.

Each request goes to the next replica that is live and not draining (round robin), streams over the
OpenAI API and is measured client-side (TTFT, TPOT, ITL), reusing the benchmark client. A request
refused by a draining replica (503) is retried once on another replica, as a Service's endpoints
would drop the draining pod. A phase may name its objective (`x-stallfree-objective`): the router serves it in
that objective's band and may shed it at arrival (429), which the summary counts as shed, not failed.
"""
from __future__ import annotations

import asyncio
import itertools
import random
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import httpx

from stallfree.arrivals import arrival_times
from stallfree.loadgen.outcome import shed
from stallfree.loadgen.prompts import PromptBuilder
from stallfree.loadgen.stream import RequestResult, send_request, streaming_body
from stallfree.operator.router.objectives import OBJECTIVE_HEADER
from stallfree.simulator.latency_summary import summarize


@dataclass(frozen=True)
class LoadPhase:
    label: str
    duration_s: float
    rate_per_s: float  # Poisson arrivals (stallfree.arrivals, the driver's seeded rng)
    prompt_tokens: int
    max_tokens: int
    objective: str | None = None  # the objective its requests name (None: the service's default)

    def to_dict(self) -> dict[str, Any]:
        return {"label": self.label, "duration_s": self.duration_s, "rate_per_s": self.rate_per_s,
                "prompt_tokens": self.prompt_tokens, "max_tokens": self.max_tokens, "objective": self.objective}


@dataclass
class PhasedResult:
    phase: str
    result: RequestResult
    replica: str | None = None
    objective: str | None = None


class LoadDriver:
    def __init__(self, urls: Callable[[], list[str]], model: str, prompts: PromptBuilder, seed: int = 0,
                 request_timeout_s: float = 600.0, max_in_flight: int = 512) -> None:
        self.urls = urls
        self.model = model
        self.prompts = prompts
        self.rng = random.Random(seed)
        self.request_timeout_s = request_timeout_s
        self.max_in_flight = max_in_flight
        self.results: list[PhasedResult] = []
        self.phase_starts: list[tuple[float, LoadPhase]] = []
        self._counter = itertools.count()
        self._round_robin = itertools.count()
        self._in_flight = 0

    @property
    def in_flight(self) -> int:
        """Requests sent and not yet ended (what a drain waits for)."""
        return self._in_flight

    async def run(self, phases: Iterable[LoadPhase], started: float,
                  on_phase: Callable[[LoadPhase], None] | None = None, stop: asyncio.Event | None = None) -> None:
        """Send every phase's arrivals; returns once all sent requests ended (or `stop` is set). Each phase is
        taken from `phases` when the one before it ends, so a generator may decide it from what it saw."""
        tasks: list[asyncio.Task] = []
        limits = httpx.Limits(max_connections=self.max_in_flight, max_keepalive_connections=self.max_in_flight)
        async with httpx.AsyncClient(timeout=httpx.Timeout(self.request_timeout_s, connect=5.0),
                                     limits=limits) as client:
            for phase in phases:
                self.phase_starts.append((time.time() - started, phase))
                if on_phase:
                    on_phase(phase)
                phase_start = time.monotonic()
                phase_end = phase_start + phase.duration_s
                # Sent at their scheduled times, not one sleep after the last send: a busy event loop delays a
                # request but does not lower the rate.
                for at in arrival_times(phase.rate_per_s, self.rng, start=phase_start, end=phase_end):
                    if await _stopped_by(at, stop):
                        break
                    if sum(not t.done() for t in tasks) < self.max_in_flight:
                        tasks.append(asyncio.create_task(self._one(client, phase, started)))
                if await _stopped_by(phase_end, stop):  # the phase lasts its duration after its last arrival
                    break
            # In-flight requests always get their answer: the daemons finish them even while draining.
            await asyncio.gather(*tasks, return_exceptions=True)

    async def alone(self, phase: LoadPhase, started: float) -> RequestResult:
        """One request of `phase`, sent and awaited before any other load (a calibration probe)."""
        async with httpx.AsyncClient(timeout=httpx.Timeout(self.request_timeout_s, connect=5.0)) as client:
            await self._one(client, phase, started)
        return self.results[-1].result

    async def _one(self, client: httpx.AsyncClient, phase: LoadPhase, started: float) -> None:
        index = next(self._counter)
        result = RequestResult(index, phase.prompt_tokens, phase.max_tokens, time.time() - started)
        record = PhasedResult(phase.label, result, objective=phase.objective)
        self.results.append(record)
        prompt = self.prompts.text(phase.prompt_tokens, seed=index, lead=f"{index}:")
        body = streaming_body("completions", self.model, prompt, phase.max_tokens)
        headers = {OBJECTIVE_HEADER: phase.objective} if phase.objective else None
        self._in_flight += 1
        try:
            await self._send(client, body, result, record, started, headers)
        except asyncio.CancelledError:
            result.error = "cancelled: still running when the drain timeout ran out"
            raise
        finally:
            self._in_flight -= 1

    async def _send(self, client: httpx.AsyncClient, body: dict[str, Any], result: RequestResult,
                    record: PhasedResult, started: float, headers: dict[str, str] | None = None) -> None:
        for _attempt in range(2):
            urls = self.urls()
            if not urls:
                result.error = "no ready replica"
                return
            url = urls[next(self._round_robin) % len(urls)]
            record.replica = url
            result.error = None
            result.sent_s = time.time() - started
            await send_request(client, url + "/v1/completions", body, result, "completions", headers=headers)
            if result.ok or not (result.error or "").startswith("HTTP 503"):
                return

    def summary(self) -> dict[str, Any]:
        """Client-side figures per phase and overall."""
        by_phase: dict[str, list[RequestResult]] = {}
        for record in self.results:
            by_phase.setdefault(record.phase, []).append(record.result)
        out = {label: _summary(results) for label, results in by_phase.items()}
        out["all"] = _summary([r.result for r in self.results])
        return out


async def _stopped_by(when: float, stop: asyncio.Event | None) -> bool:
    """Sleep until `when` (time.monotonic()); True, at once, when `stop` is set first."""
    delay = max(0.0, when - time.monotonic())
    if stop is None:
        await asyncio.sleep(delay)
        return False
    try:
        await asyncio.wait_for(stop.wait(), delay)
    except TimeoutError:
        return stop.is_set()
    return True


def _summary(results: list[RequestResult]) -> dict[str, Any]:
    done = [r for r in results if r.ok]
    sheds = sum(map(shed, results))
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok and not shed(r):
            key = (r.error or "still running")[:100]
            errors[key] = errors.get(key, 0) + 1
    return {
        "requests": len(results),
        "completed": len(done),
        "shed": sheds,  # refused at arrival by the router (a sheddable objective predicted to miss): not failed
        "failed": len(results) - len(done) - sheds,
        "ttft_ms": summarize(r.ttft_ms for r in done),
        "tpot_ms": summarize(r.tpot_ms for r in done if r.tpot_ms is not None),
        "itl_ms": summarize(gap for r in done for gap in r.itl_ms),
        "errors": errors,
    }
