"""`stallfree bench router --objectives`: how the two-objective run is judged, a refusal's fields as the client sees
them, and (slow) one short run through the real router."""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from stallfree.bench import router as bench_router
from stallfree.bench.router_objectives import ObjectivesConfig, judge
from stallfree.loadgen.outcome import outcome as classify
from stallfree.loadgen.stream import RequestResult, send_request


def served(ttft_ms: float) -> RequestResult:
    return RequestResult(0, 100, 8, 0.0, ok=True, ttft_ms=ttft_ms, tpot_ms=10.0)


def refused(status: int | None, code: str | None, retry_after_s: float | None = 1.0) -> RequestResult:
    return RequestResult(0, 3000, 8, 0.0, error="HTTP ...", status=status, refusal_code=code,
                         retry_after_s=retry_after_s)


def goals(result: dict) -> dict[str, bool]:
    return {g["goal"].split(" (")[0].split(" <=")[0]: g["met"] for g in result["goals"]}


def test_a_clean_flood_meets_every_goal_and_counts_sheds_against_goodput_only():
    config = ObjectivesConfig(interactive_ttft_ms=500, batch_ttft_ms=4000, flood_bound=1.5)
    alone = [served(100.0 + i) for i in range(100)]
    with_flood = [served(130.0 + i) for i in range(100)]
    batch = [served(3000.0)] * 3 + [served(5000.0)] + [refused(429, "shed_predicted_miss")] * 6
    result = judge(alone, with_flood, batch, config)
    assert all(goals(result).values()), result["goals"]
    b = result["figures"]["flood"]["batch"]
    assert (b["served"], b["shed"], b["lost"], b["served_late"]) == (4, 6, 0, 1)
    assert b["goodput"] == pytest.approx(0.3)  # 3 of 10 met the target: the late one and the sheds did not
    assert result["figures"]["interactive_p99_ttft_ratio"] == pytest.approx(229.0 / 199.0, rel=0.01)


def test_each_goal_misses_on_its_own_failure():
    config = ObjectivesConfig(flood_bound=1.5)
    alone = [served(100.0)] * 50
    ok_batch = [refused(429, "shed_predicted_miss")]
    # Interactive three times slower beside the flood: the bound misses, nothing else does.
    slow = judge(alone, [served(300.0)] * 50, ok_batch, config)
    assert [g for g, met in goals(slow).items() if not met] == ["interactive p99 TTFT with the flood"]
    # A batch request that waited in the router's queue and then timed out (503): not refused at arrival.
    waited = judge(alone, alone, ok_batch + [refused(503, "queue_timeout")], config)
    assert [g for g, met in goals(waited).items() if not met] == [
        "every batch request served or refused at arrival"]
    # A shed without Retry-After is no clean shed.
    bare = judge(alone, alone, [refused(429, "shed_predicted_miss", None)], config)
    assert not goals(bare)["every batch request served or refused at arrival"]
    # No answer at all (a broken connection, the time limit): lost, wherever it happens.
    lost = judge(alone + [refused(None, None)], alone, ok_batch, config)
    assert not goals(lost)["0 lost"] and not goals(lost)["every interactive request served"]
    # An interactive request refused (it should have waited): not served, though not lost.
    shed_interactive = judge(alone, alone + [refused(429, "queue_full")], ok_batch, config)
    assert goals(shed_interactive)["0 lost"] and not goals(shed_interactive)["every interactive request served"]


def test_classify_tells_refusals_at_arrival_from_after_waiting_and_from_losses():
    assert classify(served(1.0)) == "served"
    assert classify(refused(429, "shed_predicted_miss")) == "refused_at_arrival"
    assert classify(refused(429, "queue_full")) == "refused_at_arrival"
    assert classify(refused(503, "queue_timeout")) == "refused_after_waiting"
    assert classify(refused(None, None)) == "lost"


def test_the_client_keeps_a_refusals_status_code_and_retry_after():
    body = {"error": {"message": "predicted to miss", "type": "rate_limit", "code": "shed_predicted_miss"}}

    def answer(request: httpx.Request) -> httpx.Response:
        assert request.headers["x-stallfree-objective"] == "batch"
        return httpx.Response(429, json=body, headers={"retry-after": "3"})

    async def go() -> RequestResult:
        result = RequestResult(0, 10, 4, 0.0)
        async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as client:
            await send_request(client, "http://router/v1/completions", {"prompt": "x"}, result, "completions",
                               headers={"x-stallfree-objective": "batch"})
        return result

    result = asyncio.run(go())
    assert (result.ok, result.status, result.refusal_code, result.retry_after_s) == (
        False, 429, "shed_predicted_miss", 3.0)
    assert classify(result) == "refused_at_arrival"


def test_bad_objectives_flags_are_refused(capsys):
    assert bench_router.main(["--objectives", "--flood-bound", "0.5"]) == 2
    assert "--flood-bound" in capsys.readouterr().err


@pytest.mark.slow
def test_quick_objectives_run_through_the_real_router(tmp_path):
    out = tmp_path / "objectives.json"
    code = bench_router.main(["--objectives", "--quick", "--json", str(out), "--log-dir", str(tmp_path / "logs")])
    data = json.loads(out.read_text())
    figures = data["objectives"]["figures"]
    assert figures["alone"]["interactive"]["requests"] > 0 and figures["flood"]["batch"]["requests"] > 0
    met = {g["goal"]: g["met"] for g in data["goals"]}
    # --quick judges every goal but the p99 ratio (seconds of load say little about a p99).
    assert [m for g, m in met.items() if g.startswith("interactive p99")] == [None]
    assert all(m for g, m in met.items() if not g.startswith("interactive p99")), data["goals"]
    assert code == 0
