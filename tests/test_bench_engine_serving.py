"""`bench engine --url`'s serving-load row: Poisson arrivals, the serving benchmark's figures, every request sent."""
from __future__ import annotations

import asyncio
import json
import statistics
import time

import httpx

from stallfree.bench import engine_serving
from stallfree.bench.engine_serving import arrival_offsets, run_serving_load, summarize
from stallfree.bench.engine_streams import Target
from stallfree.bench.engine_url import URL_LABELS, fmt
from stallfree.loadgen.stream import RequestResult


def test_arrivals_are_poisson_at_the_rate_and_seeded():
    offsets = arrival_offsets(4000, 2.0, seed=7)
    gaps = [b - a for a, b in zip(offsets, offsets[1:])]
    assert offsets[0] == 0.0 and min(gaps) >= 0.0
    assert abs(statistics.mean(gaps) - 0.5) < 0.05  # exponential gaps of mean 1/rate
    assert abs(statistics.stdev(gaps) - 0.5) < 0.05  # ... whose spread equals their mean (not evenly spaced)
    assert arrival_offsets(10, 2.0, seed=7) == offsets[:10]
    assert arrival_offsets(10, 2.0, seed=8) != offsets[:10]


def _result(ttft: float, tpot: float, tokens: int, ok: bool = True) -> RequestResult:
    r = RequestResult(0, 0, tokens, 0.0, ok=ok, ttft_ms=ttft, tpot_ms=tpot, output_tokens=tokens if ok else 0)
    r.itl_ms = [tpot] * (tokens - 1)
    return r


def test_the_figures_are_read_as_the_serving_benchmark_reads_them():
    results = [_result(100.0 * i, 10.0 * i, 5) for i in range(1, 11)] + [_result(0.0, 0.0, 5, ok=False)]
    row = summarize(results, wall_s=5.0, rate=2.0)
    assert row["value"] == 10 / 5.0 and row["failed"] == 1 and row["requests"] == 11
    assert row["output_tok_s"] == 50 / 5.0
    assert row["ttft_median_ms"] == 500.0 and row["ttft_p99_ms"] == 1000.0  # nearest rank over the 10 done
    assert row["tpot_median_ms"] == 50.0 and row["tpot_p99_ms"] == 100.0 and row["itl_p99_ms"] == 100.0
    printed = fmt(row)
    assert printed.startswith("2.00 req/s") and "TTFT median 500 / p99 1,000 ms" in printed
    assert "1 of 11 failed" in printed
    assert "serving_load" in URL_LABELS


def test_every_request_is_sent_at_its_arrival_and_streamed(monkeypatch):
    sent: list[float] = []

    def handle(request: httpx.Request) -> httpx.Response:
        sent.append(time.perf_counter())
        body = json.loads(request.content)
        events = [{"choices": [{"text": f"t{i}"}]} for i in range(body["max_tokens"])]
        events.append({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": body["max_tokens"]}})
        text = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
        return httpx.Response(200, content=text.encode(), headers={"content-type": "text/event-stream"})

    monkeypatch.setattr(engine_serving, "client",
                        lambda timeout_s: httpx.AsyncClient(transport=httpx.MockTransport(handle)))
    started = time.perf_counter()
    row = asyncio.run(run_serving_load(Target("http://x", "m"), ["a", "b", "c", "d", "e"], 4, rate=20.0, seed=3,
                                       timeout_s=10.0))
    assert row["value"] > 0 and row["failed"] == 0 and row["output_tok_s"] == 20 / row["duration_s"]
    offsets = arrival_offsets(5, 20.0, seed=3)
    assert [round(t - started, 2) >= round(o, 2) for t, o in zip(sorted(sent), offsets)] == [True] * 5
    assert row["duration_s"] >= offsets[-1]
