"""One engine loop: the simulator and the sim daemon over HTTP serve a workload with the same schedule.

The same four requests go through `VirtualReplica` (virtual time) and through a live `stallfree serve
--backend sim` daemon (real time, OpenAI API on loopback). The first request arrives alone; the others
arrive while its first iteration runs (a 500 ms per-iteration overhead keeps that iteration long, and
the test checks over HTTP that all were admitted before it ended), so both runs see the same arrivals
at iteration granularity and must make the same decisions: the same per-request token counts, the same
number of iterations and the same tokens per iteration (the daemon's /metrics histograms against the
simulator's iteration log).
"""
from __future__ import annotations

import asyncio
import json

import httpx
from prometheus_client.parser import text_string_to_metric_families

from stallfree.contracts import Ceilings, Tuning
from stallfree.node_daemon.engine.config import SchedulerConfig
from stallfree.node_daemon.server.metrics import ITERATION_TOKEN_BUCKETS
from stallfree.node_daemon.sim.backend import build_cost_model
from stallfree.simulator.virtual_replica import VirtualReplica
from stallfree.simulator.workload import RequestSpec, prompt_token_ids
from tests.server_helpers import running_daemon

OVERHEAD_MS = 500.0
SIM_DAEMON = ["--backend", "sim", "--model", "mistral-7b", "--hardware", "a100", "--max-model-len", "4096",
              "--max-token-budget", "512", "--token-budget", "512", "--max-num-seqs-ceiling", "16", "--max-num-seqs", "16",
              "--num-kv-blocks", "4096", "--no-profile", "--overhead-ms", str(OVERHEAD_MS)]
# (prompt tokens, max_tokens): a chunked prompt first, then prompts that join while it prefills.
WORKLOAD = [(1200, 4), (300, 6), (700, 3), (100, 5)]
HISTOGRAMS = {"stallfree_iteration_prefill_tokens": 0, "stallfree_iteration_decode_tokens": 1,
              "stallfree_iteration_tokens": 2}


def _prompts() -> list[list[int]]:
    return [prompt_token_ids(RequestSpec(0.0, p, o), i, 0, 256) for i, (p, o) in enumerate(WORKLOAD)]


class _Iterations:
    def __init__(self) -> None:
        self.rows: list[tuple[int, int, int]] = []

    def on_iteration(self, record) -> None:
        self.rows.append((record.num_prefill_tokens, record.num_decode_tokens,
                          record.num_prefill_tokens + record.num_decode_tokens))

    def on_token(self, request, now, first) -> None:
        pass

    def on_finished(self, request, now) -> None:
        pass


def _simulate() -> tuple[dict[int, tuple[int, int]], list[tuple[int, int, int]]]:
    cost = build_cost_model("mistral-7b", "a100", overhead_ms=OVERHEAD_MS)
    config = SchedulerConfig(ceilings=Ceilings(512, 16), tuning=Tuning(512, 16), max_model_len=4096)
    log = _Iterations()
    replica = VirtualReplica(cost, config, num_kv_blocks=4096, keep_records=True, observer=log)
    for i, ((_, max_tokens), tokens) in enumerate(zip(WORKLOAD, _prompts())):
        # The first alone at 0; the rest during its first iteration (which lasts more than the overhead).
        replica.submit(len(tokens), max_tokens, arrival_time=0.0 if i == 0 else 0.01 * i, prompt_token_ids=tokens,
                       request_id=str(i))
    replica.run_until_idle()
    counts = {int(r.request_id): (r.prompt_len, r.num_output_tokens) for r in replica.finished}
    return counts, log.rows


def _buckets(values: list[int]) -> dict[float, int]:
    return {le: sum(1 for v in values if v <= le) for le in ITERATION_TOKEN_BUCKETS}


def _scrape(text: str) -> dict[str, dict]:
    """Counters and iteration histograms of the daemon's /metrics, by family."""
    out: dict[str, dict] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.endswith("_bucket") and family.name in HISTOGRAMS:
                le = float(sample.labels["le"])
                if le in ITERATION_TOKEN_BUCKETS:
                    out.setdefault(family.name, {})[le] = int(sample.value)
            elif sample.name in ("stallfree_iterations_total", "stallfree_generation_tokens_total",
                                 "stallfree_prefill_tokens_computed_total"):
                out[sample.name] = {"value": int(sample.value)}
    return out


async def _usage(response: httpx.Response) -> dict:
    """Read an SSE completion to its end; its usage chunk."""
    usage = None
    async for line in response.aiter_lines():
        if line.startswith("data: {"):
            usage = json.loads(line[6:]).get("usage") or usage
    await response.aclose()
    return usage


async def _serve_over_http(url: str, admin_headers: dict) -> tuple[list[dict], dict[str, dict], dict[str, dict]]:
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        responses = []
        for i, ((_, max_tokens), tokens) in enumerate(zip(WORKLOAD, _prompts())):
            body = {"model": "mistral-7b", "prompt": tokens, "max_tokens": max_tokens, "stream": True,
                    "stream_options": {"include_usage": True}}
            # The response headers come back once the server has queued the request for the engine, so
            # opening the streams one after another hands them to the engine in this order.
            response = await client.send(client.build_request("POST", "/v1/completions", json=body), stream=True)
            assert response.status_code == 200, await response.aread()
            responses.append(response)
            if i == 0:  # the engine was idle: it takes the first request at once and starts its iteration
                while True:
                    stats = (await client.get("/admin/stats", headers=admin_headers)).json()
                    if stats["num_waiting"] + stats["num_running"] == 1:
                        break
                    await asyncio.sleep(0.002)
        # Everything was queued while the first iteration still ran: the arrivals are the simulation's.
        during_first = _scrape((await client.get("/metrics")).text)
        usages = await asyncio.gather(*(_usage(r) for r in responses))
        return usages, during_first, _scrape((await client.get("/metrics")).text)


def test_simulator_and_sim_daemon_over_http_make_the_same_schedule():
    expected_counts, iterations = _simulate()
    assert len(iterations) >= 6  # chunks, mixed iterations, decodes: not a trivial schedule
    with running_daemon(SIM_DAEMON) as live:
        usages, during_first, metrics = asyncio.run(_serve_over_http(live.url, live.admin_headers))
        live.wait_idle()
    assert during_first.get("stallfree_iterations_total", {"value": 0})["value"] == 0, (
        f"the requests were not all sent within the first {OVERHEAD_MS:g} ms iteration: the machine is too busy")
    for i, usage in enumerate(usages):
        assert (usage["prompt_tokens"], usage["completion_tokens"]) == expected_counts[i] == WORKLOAD[i]
    assert metrics["stallfree_iterations_total"]["value"] == len(iterations)
    assert metrics["stallfree_generation_tokens_total"]["value"] == sum(o for _, o in WORKLOAD)
    assert metrics["stallfree_prefill_tokens_computed_total"]["value"] == sum(r[0] for r in iterations)
    for name, column in HISTOGRAMS.items():
        assert metrics[name] == _buckets([row[column] for row in iterations]), name
