"""`stallfree serve --speculative ngram` end to end on the tiny model: the usage's speculation field, the /metrics
counters, and `stallfree bench speculation` reading them through its OpenAI-compatible client."""
from __future__ import annotations

import json
import re

import httpx
from server_helpers import running_daemon

from stallfree.bench import speculation as bench


def _metric(text: str, name: str) -> float:
    match = re.search(rf"^{name}{{[^}}]*}} ([0-9.e+]+)$", text, re.MULTILINE)
    assert match, name
    return float(match.group(1))


def test_drafts_show_in_the_usage_the_metrics_and_the_bench(tmp_path) -> None:
    with running_daemon(["--speculative", "ngram", "--no-profile"]) as live:
        body = {"model": "tiny", "prompt": "one two three one two three one two three one two", "max_tokens": 48,
                "temperature": 0.0, "ignore_eos": True}
        response = httpx.post(f"{live.url}/v1/completions", json=body, timeout=120).json()
        usage = response["usage"]
        spec = usage["speculation"]
        assert usage["completion_tokens"] == 48
        assert spec["draft_tokens"] > 0 and spec["draft_tokens"] == spec["accepted_tokens"] + spec["rejected_tokens"]
        out = tmp_path / "spec.json"
        assert bench.main(["--url", live.url, "--workload", "echo", "--rounds", "1", "--max-tokens", "16",
                           "--ignore-eos", "--json", str(out)]) == 0
        echo = json.loads(out.read_text())["workloads"]["echo"]
        assert echo["requests"] == len(bench.echo_prompts()) and echo["output_tokens"] == 16 * echo["requests"]
        assert echo["draft_tokens"] > 0  # from the streamed usage's speculation field
        assert 0 < echo["p50_tpot_ms"] <= echo["p99_tpot_ms"]
        # a TPOT SLO no server meets is a goal missed: the command says so and exits 1
        assert bench.main(["--url", live.url, "--workload", "echo", "--rounds", "1", "--max-tokens", "8",
                           "--tpot-slo-ms", "0.001"]) == 1
        live.wait_idle()
        metrics = httpx.get(f"{live.url}/metrics", timeout=30).text
        drafted = _metric(metrics, "stallfree_spec_draft_tokens_total")
        accepted = _metric(metrics, "stallfree_spec_accepted_tokens_total")
        rejected = _metric(metrics, "stallfree_spec_rejected_tokens_total")
        assert drafted >= spec["draft_tokens"] + echo["draft_tokens"] and drafted == accepted + rejected
