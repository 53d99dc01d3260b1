"""The admin API the operator drives (tuning, stats, profile), health/ready/metrics, and API-key auth."""
from __future__ import annotations

import dataclasses

import httpx
import openai
import pytest

from stallfree.contracts import Profile, Tuning, WindowStats
from stallfree.node_daemon.measure.profiler import starting_tuning, suggest_token_budget

from server_helpers import LiveDaemon, running_daemon

MODEL = "tiny"
TPOT_SLO_MS = 40.0


@pytest.fixture(scope="module")
def live() -> LiveDaemon:
    # Started the way the operator starts a daemon: a TPOT SLO and an automatic budget.
    with running_daemon(["--token-budget", "auto", "--tpot-slo-ms", str(TPOT_SLO_MS), "--stats-window-s", "60"]) as live:
        yield live


def test_health_ready_and_metrics(live: LiveDaemon) -> None:
    assert httpx.get(live.url + "/health").json() == {"status": "ok"}
    assert httpx.get(live.url + "/ready").json() == {"ready": True}
    metrics = httpx.get(live.url + "/metrics")
    assert metrics.headers["content-type"].startswith("text/plain")
    budget = live.daemon.engine.get_tuning().token_budget
    assert f'stallfree_token_budget{{model_name="{MODEL}"}} {float(budget)}' in metrics.text


def test_starting_budget_comes_from_the_profile_and_the_tpot_slo(live: LiveDaemon) -> None:
    body = httpx.get(live.url + "/admin/profile", headers=live.admin_headers).json()
    profile = Profile.from_dict(body)
    assert profile.device == "cpu"
    assert profile.decode_only and profile.mixed
    assert [p.tokens for p in profile.mixed] == sorted(p.tokens for p in profile.mixed)
    assert all(p.num_decodes == p.tokens for p in profile.decode_only)
    # The daemon's state is frozen: the profile arrives only through the start-up's hand-off.
    assert profile == live.daemon.startup.profile
    with pytest.raises(dataclasses.FrozenInstanceError):
        live.daemon.tpot_slo_ms = 1.0
    engine = live.daemon.engine
    expected = starting_tuning(profile, TPOT_SLO_MS, engine.ceilings, Tuning(max_num_seqs=64))
    tuning = Tuning(**httpx.get(live.url + "/admin/tuning", headers=live.admin_headers).json())
    assert (tuning.token_budget, tuning.max_num_seqs) == (expected.token_budget, expected.max_num_seqs)
    assert body["tpot_slo_ms"] == TPOT_SLO_MS
    # /admin/profile suggests the budget the daemon started with.
    assert body["suggested_token_budget"] == tuning.token_budget == \
        suggest_token_budget(profile, TPOT_SLO_MS, engine.ceilings, Tuning(max_num_seqs=64))


def test_profile_suggests_a_budget_for_any_target(live: LiveDaemon) -> None:
    headers = live.admin_headers
    profile = Profile.from_dict(httpx.get(live.url + "/admin/profile", headers=headers).json())
    generous = httpx.get(live.url + "/admin/profile", params={"tpot_slo_ms": 1e6}, headers=headers).json()
    assert generous["suggested_token_budget"] == max(p.tokens for p in profile.mixed)
    tight = httpx.get(live.url + "/admin/profile", params={"tpot_slo_ms": 1e-3}, headers=headers).json()
    assert tight["suggested_token_budget"] <= generous["suggested_token_budget"]
    bad = httpx.get(live.url + "/admin/profile", params={"tpot_slo_ms": -5}, headers=headers)
    assert bad.status_code == 400


def test_put_tuning_is_partial_live_and_shown_in_metrics(live: LiveDaemon) -> None:
    headers = live.admin_headers
    before = httpx.get(live.url + "/admin/tuning", headers=headers).json()
    try:
        put = httpx.put(live.url + "/admin/tuning", json={"max_partial_prefills": 2, "long_prefill_threshold": 64},
                        headers=headers)
        assert put.status_code == 200
        assert put.json() == {**before, "max_partial_prefills": 2, "long_prefill_threshold": 64}
        assert httpx.get(live.url + "/admin/tuning", headers=headers).json() == put.json()
        text = httpx.get(live.url + "/metrics").text
        assert f'stallfree_max_partial_prefills{{model_name="{MODEL}"}} 2.0' in text
        assert f'stallfree_long_prefill_threshold{{model_name="{MODEL}"}} 64.0' in text
        r = httpx.post(live.url + "/v1/completions", json={"model": MODEL, "prompt": list(range(20, 220)),
                                                           "max_tokens": 4, "ignore_eos": True}, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    finally:
        httpx.put(live.url + "/admin/tuning", json=before, headers=headers)


def test_stats_are_what_the_operator_parses(live: LiveDaemon) -> None:
    for i in range(5):
        r = httpx.post(live.url + "/v1/completions", json={"model": MODEL, "prompt": f"stats {i}", "max_tokens": 6,
                                                           "ignore_eos": True}, timeout=30)
        assert r.status_code == 200
    live.wait_idle()
    body = httpx.get(live.url + "/admin/stats", headers=live.admin_headers).json()
    stats = WindowStats.from_dict(body)  # exactly the contract's keys, nothing extra
    assert stats.window_s == 60.0
    assert stats.ttft_ms.count >= 5 and stats.tpot_ms.count >= 5 and stats.itl_ms.count >= 25
    assert stats.ttft_ms.p50 <= stats.ttft_ms.p99 <= stats.ttft_ms.max
    assert stats.queue_wait_ms.count >= 5
    assert stats.request_rate > 0 and stats.prompt_tokens_per_s > 0 and stats.generation_tokens_per_s > 0
    assert stats.prefill_tokens_per_s > 0 and stats.decode_tokens_per_s > 0
    assert 0 < stats.budget_utilisation <= 1
    assert stats.num_running == 0 and stats.num_waiting == 0 and stats.kv_usage == 0.0  # live, not stale
    assert stats.tuning == live.daemon.engine.get_tuning()
    assert stats.ceilings == live.daemon.engine.ceilings
    assert stats.iterations > 0 and stats.mean_iteration_ms > 0


def test_api_key_and_closed_admin(tmp_path) -> None:
    key_file = tmp_path / "api-key"
    key_file.write_text("sk-test-key\n")
    with running_daemon(["--api-key-file", str(key_file), "--no-profile"], admin_token=None) as live:
        assert httpx.get(live.url + "/v1/models").status_code == 401
        assert httpx.get(live.url + "/v1/models", headers={"Authorization": "Bearer nope"}).status_code == 401
        client = openai.OpenAI(base_url=live.url + "/v1", api_key="sk-test-key", max_retries=0)
        r = client.completions.create(model=MODEL, prompt="keyed", max_tokens=2)
        assert r.usage.completion_tokens >= 1
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=live.url + "/v1", api_key="wrong", max_retries=0).models.list()
        # /health, /ready and /metrics stay open for probes and scrapers.
        assert httpx.get(live.url + "/ready").status_code == 200
        assert httpx.get(live.url + "/metrics").status_code == 200
        # No admin token configured: the admin API is closed, not open.
        closed = httpx.get(live.url + "/admin/tuning")
        assert closed.status_code == 403 and closed.json()["error"]["code"] == "admin_disabled"
        assert httpx.get(live.url + "/admin/profile", headers={"Authorization": "Bearer x"}).status_code == 403
