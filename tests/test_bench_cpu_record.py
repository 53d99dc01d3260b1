"""bench/cpu_record.py: every `bench engine` result names the CPU's tier and flags and the paths its daemons took."""
from __future__ import annotations

import json

from stallfree.bench import engine as bench_engine
from stallfree.bench.cpu_record import cpu_record, paths_from_logs
from stallfree.node_daemon.models.cpu_tier import TIERS


def test_cpu_record_names_the_tier_and_its_flags(monkeypatch):
    monkeypatch.delenv("STALLFREE_CPU_TIER", raising=False)
    record = cpu_record()
    assert record["tier"] in TIERS and record["tier"] == record["detected_tier"] and record["forced_tier"] is None
    assert isinstance(record["flags"], list) and record["cores"] >= 1
    if record["tier"] != "generic":
        assert "avx2" in record["flags"]


def test_a_forced_lower_tier_is_recorded(monkeypatch):
    monkeypatch.setenv("STALLFREE_CPU_TIER", "generic")
    record = cpu_record()
    assert record["forced_tier"] == "generic" and record["tier"] == "generic"


def test_a_forced_tier_the_cpu_lacks_is_recorded_as_an_error(monkeypatch):
    monkeypatch.setenv("STALLFREE_CPU_TIER", "no-such-tier")
    record = cpu_record()
    assert record["tier"] is None and "no-such-tier" in record["tier_error"]


def test_paths_are_read_from_each_daemons_last_start_up_line(tmp_path):
    (tmp_path / "main.log").write_text("INFO x CPU paths: cpu_tier avx2, forward python (compiling)\n"
                                       "INFO x CPU paths: cpu_tier avx2, forward compiled, matmul avx2 code\n")
    (tmp_path / "other.log").write_text("nothing here\n")
    assert paths_from_logs(tmp_path) == {"main": "cpu_tier avx2, forward compiled, matmul avx2 code"}


def test_bench_engine_json_carries_the_cpu(tmp_path):
    out = tmp_path / "engine.json"
    assert bench_engine.main(["--quick", "--backend", "sim", "--model", "llama-3-8b", "--hardware", "h100",
                              "--output", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["cpu"]["tier"] in TIERS and isinstance(data["cpu"]["flags"], list)
    assert isinstance(data["cpu_paths"], dict)
