"""Faults across real daemon processes: a replica killed mid-stream, scale-in that drains, a restarted control loop."""
from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from daemon_helpers import REPO, local_daemons
from stallfree.operator.local.manifest import load_manifest
from stallfree.operator.local.load import LoadDriver, LoadPhase
from stallfree.operator.local.runtime import LocalRuntime
from stallfree.loadgen.prompts import PromptBuilder

pytestmark = pytest.mark.slow


async def _stream(client: httpx.AsyncClient, url: str, max_tokens: int, started: list | None = None) -> dict:
    """One streaming completion: its token count, and how it ended (done / error with the reason).

    The count is the server's usage once the stream completes, else the content events seen so far. `started` gets
    the url once the first token came.
    """
    tokens = 0
    body = {"model": "llama-3-8b", "prompt": "tell me a long story", "max_tokens": max_tokens,
            "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
            if response.status_code != 200:
                return {"end": "refused", "status": response.status_code, "tokens": 0}
            async for line in response.aiter_lines():
                if line == "data: [DONE]":
                    return {"end": "done", "tokens": tokens}
                if line.startswith("data:"):
                    event = json.loads(line[5:])
                    if "error" in event:
                        return {"end": "error", "reason": event["error"]["message"], "tokens": tokens}
                    if event.get("usage"):
                        tokens = event["usage"]["completion_tokens"]
                    elif event["choices"] and event["choices"][0].get("text"):
                        tokens += 1
                        if tokens == 1 and started is not None:
                            started.append(url)
        return {"end": "error", "reason": "closed without [DONE]", "tokens": tokens}
    except httpx.HTTPError as exc:
        return {"end": "error", "reason": type(exc).__name__, "tokens": tokens}


async def _until(check, what: str, timeout_s: float = 30.0) -> None:
    """Poll `check` (a function or a coroutine function) until it is true; fail naming `what` past the deadline."""
    deadline = time.monotonic() + timeout_s
    while not (await check() if asyncio.iscoroutinefunction(check) else check()):
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}"
        await asyncio.sleep(0.05)


def test_a_killed_daemon_fails_only_its_own_streams_explicitly_and_is_restarted(tmp_path):
    with local_daemons(tmp_path, 2) as daemons:
        victim, survivor = daemons.replicas

        async def scenario():
            async with httpx.AsyncClient(timeout=httpx.Timeout(60.0, connect=3.0)) as client:
                started: list[str] = []
                tasks = [asyncio.create_task(_stream(client, r.url, 300, started))
                         for r in (victim, survivor) for _ in range(6)]
                await _until(lambda: len(started) == 12, "every stream mid-flight")
                daemons.kill(victim.name)
                return await asyncio.wait_for(asyncio.gather(*tasks), timeout=60)

        results = asyncio.run(scenario())
        on_victim, on_survivor = results[:6], results[6:]
        assert all(r == {"end": "done", "tokens": 300} for r in on_survivor), on_survivor
        # The killed streams end with an explicit error (the connection dropped), never a hang or a false [DONE].
        assert all(r["end"] == "error" and r["tokens"] < 300 for r in on_victim), on_victim

        assert daemons.restart_dead() == [victim.name]
        assert daemons.wait_ready(60)
        after = asyncio.run(_one_more(daemons.replicas[0].url))
        assert after == {"end": "done", "tokens": 5}


async def _one_more(url: str) -> dict:
    async with httpx.AsyncClient(timeout=30) as client:
        return await _stream(client, url, 5)


def test_scale_in_drains_in_flight_requests_and_refuses_new_ones(tmp_path):
    with local_daemons(tmp_path, 2) as daemons:
        leaving = daemons.replicas[-1]

        async def scenario():
            async with httpx.AsyncClient(timeout=httpx.Timeout(60.0, connect=3.0)) as client:
                started: list[str] = []
                tasks = [asyncio.create_task(_stream(client, leaving.url, 200, started)) for _ in range(6)]
                await _until(lambda: len(started) == 6, "every stream mid-flight")
                daemons.scale_to(1)  # SIGTERM: the newest replica drains

                async def unready() -> bool:
                    try:
                        return (await client.get(f"{leaving.url}/ready")).status_code != 200
                    except httpx.HTTPError:  # its port already closed
                        return True

                await _until(unready, "the leaving replica unready")
                late = await _stream(client, leaving.url, 5)
                return await asyncio.gather(*tasks), late

        in_flight, late = asyncio.run(scenario())
        assert all(r == {"end": "done", "tokens": 200} for r in in_flight), in_flight
        # A draining daemon answers new work with 503 (or has already closed its port): never accepted and lost.
        assert late["end"] in ("refused", "error") and late["tokens"] == 0, late
        if late["end"] == "refused":
            assert late["status"] == 503
        deadline = time.monotonic() + 30
        while not daemons.reap() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not daemons.draining and len(daemons.replicas) == 1


def test_a_restarted_control_loop_resumes_from_its_recorded_state_without_scaling_twice(tmp_path):
    _, spec = load_manifest(str(REPO / "manifests/examples/llama-3-8b-sim.yaml"))
    spec = spec.model_copy(update={"scaling": spec.scaling.model_copy(
        update={"max_replicas": 2, "scale_up_stabilization_seconds": 2, "scale_down_stabilization_seconds": 600})})
    state_file = tmp_path / "state.json"

    async def first_run() -> int:
        runtime = LocalRuntime("resume", spec, tmp_path / "one", state_file=state_file)
        runtime.start()
        try:
            await runtime.wait_ready(90)
            load = LoadDriver(runtime.ready_urls, "llama-3-8b", PromptBuilder(chars_per_token=1.0))
            stop = asyncio.Event()
            overload = LoadPhase("overload", 60, 40.0, 1500, 16)
            task = asyncio.create_task(load.run([overload], runtime.started, stop=stop))
            try:
                for _ in range(40):
                    await asyncio.sleep(1.0)
                    await runtime.step()
                    if any(e.reason == "ScaledUp" for e in runtime.events):
                        break
            finally:
                stop.set()
                await task
            return len(runtime.daemons.replicas)
        finally:
            await runtime.close()

    async def second_run() -> tuple[int, list[str]]:
        runtime = LocalRuntime("resume", spec, tmp_path / "two", state_file=state_file)
        runtime.start()
        started_with = len(runtime.daemons.replicas)
        try:
            await runtime.wait_ready(90)
            for _ in range(4):
                await runtime.step()
                await asyncio.sleep(0.5)
            return started_with, [e.reason for e in runtime.events]
        finally:
            await runtime.close()

    assert asyncio.run(first_run()) == 2, "the overload should have scaled the service out"
    recorded = json.loads(state_file.read_text())
    assert recorded["desired_replicas"] == 2
    started_with, reasons = asyncio.run(second_run())
    assert started_with == 2  # the recorded count, not the spec's 1
    assert "ScaledUp" not in reasons and "ScaledDown" not in reasons, reasons
