"""`stallfree bench router --quick`: the policy comparison runs end to end and writes its figures."""
from __future__ import annotations

import json

import pytest

from stallfree.bench import router as bench_router

pytestmark = pytest.mark.slow


def test_quick_policy_comparison_writes_json_and_png(tmp_path):
    out, png = tmp_path / "router.json", tmp_path / "router.png"
    code = bench_router.main(["--quick", "--workload", "load", "--policies", "slo-aware,round-robin",
                              "--json", str(out), "--plot", str(png), "--log-dir", str(tmp_path / "logs")])
    assert code == 0
    data = json.loads(out.read_text())
    policies = data["load"]["policies"]
    assert set(policies) == {"slo-aware", "round-robin"}
    for result in policies.values():
        summary = result["summary"]
        assert summary["completed"] == summary["num_requests"] > 0, summary["errors"]
        assert sum(result["picks"].values()) >= summary["num_requests"]
        assert result["daemons"]["queue_wait_ms_p99"] is not None
    # Round-robin spreads evenly by construction; the goals are computed from the same figures.
    assert len(policies["round-robin"]["picks"]) == 4
    assert {g["goal"] for g in data["goals"]} >= {"load: p99 TTFT >= 30% lower than round-robin"}
    assert png.stat().st_size > 10_000


def test_bucket_quantile_interpolates_like_prometheus():
    buckets = {0.1: 50.0, 0.2: 90.0, 1.0: 100.0, float("inf"): 100.0}
    assert bench_router.bucket_quantile(buckets, 0.5) == pytest.approx(100.0)
    assert bench_router.bucket_quantile(buckets, 0.7) == pytest.approx(150.0)
    assert bench_router.bucket_quantile(buckets, 0.99) == pytest.approx(200.0 + 0.9 * 800.0)
    assert bench_router.bucket_quantile({}, 0.99) is None
