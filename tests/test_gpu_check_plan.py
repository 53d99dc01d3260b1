"""The prepared GPU check without a GPU: its roofline arithmetic, its dry run, and the sm_90 compile of the
Triton kernels (Triton's bundled ptxas assembles for Hopper on any machine)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

GPU_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "e2e", "gpu")
sys.path.insert(0, GPU_DIR)

from roofline import (Sequence, attention_kv_bytes, decode_floor_s, iteration_flops,  # noqa: E402
                      kv_bytes_read, weight_bytes_read)
from stallfree.shapes import get_shape  # noqa: E402

LLAMA = get_shape("llama-3-8b")


def test_visible_pairs_follow_the_bottom_right_causal_mask():
    # Three new tokens over two cached ones: they see 3, 4 and 5 keys.
    assert Sequence(3, 5).visible_pairs == 12
    assert Sequence(1, 100).visible_pairs == 100  # a decode sees its whole context
    assert Sequence(4, 4).visible_pairs == 10  # a fresh prefill: the lower triangle


def test_decode_bytes_are_weights_plus_every_sequence_cache():
    kv_per_token = 2 * 32 * 8 * 128 * 2  # K and V, 32 layers, 8 KV heads of 128, bf16
    batch = [Sequence(1, 1000), Sequence(1, 24)]
    assert kv_bytes_read(LLAMA, batch) == 1024 * kv_per_token
    embedding = 128256 * 4096
    assert weight_bytes_read(LLAMA, 2) == 2 * (LLAMA.num_parameters - embedding + 2 * 4096)
    floor = decode_floor_s(LLAMA, batch, 4e12)
    assert floor == pytest.approx((weight_bytes_read(LLAMA, 2) + 1024 * kv_per_token) / 4e12)
    assert 14e9 < weight_bytes_read(LLAMA, 1) < 16e9  # Llama-3-8B in bf16 without its embedding table
    assert attention_kv_bytes(LLAMA, batch) == 1024 * kv_per_token // 32


def test_iteration_flops_count_projections_head_and_attention():
    one = iteration_flops(LLAMA, [Sequence(1, 1)], sampled_rows=1)
    two = iteration_flops(LLAMA, [Sequence(1, 1), Sequence(1, 1)], sampled_rows=0)
    head = 2 * 128256 * 4096
    attention_one = 4 * 32 * 32 * 128  # one (query, key) pair in every head of every layer
    # Two unsampled tokens cost twice one token's body; the sampled one adds the LM head.
    assert one - head - attention_one == (two - 2 * attention_one) // 2
    assert 13e9 < (one - head) / 1 < 16e9  # ~2 FLOPs per non-embedding weight


DRY_SECTIONS = ["backends", "plan", "correctness", "ceilings", "engine", "attention", "fused_ops"]
VERDICTS = {"pass", "FAIL", "unverified", "unmeasured", "info", "skip", "dry run"}


def test_dry_run_runs_every_section_through_the_real_code(tmp_path):
    """The whole check on the CPU: every section runs and reports rows with verdicts; Triton (interpreted) and the
    torch path pass correctness in bf16; targets are shown, not judged; one table; the JSON says where the
    ceilings came from."""
    out = tmp_path / "dry.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, os.path.join(GPU_DIR, "gpu_check.py"), "--dry-run", "--json", str(out)],
                          capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert not report["errors"] and not report["problems"] and report["dry_run"] is True
    assert list(report["sections"]) == DRY_SECTIONS
    for name, section in report["sections"].items():
        assert section["rows"], f"section {name} reported nothing"
        for row in section["rows"]:
            assert row["verdict"] in VERDICTS and row["figure"], row
    rows = {r["check"]: r for s in report["sections"].values() for r in s["rows"]}
    triton_rows = [r for c, r in rows.items() if c.startswith("triton ") and "page" in c]
    assert len(triton_rows) == 16 and all(r["verdict"] == "pass" for r in triton_rows)  # 2 shapes x 4 kinds x 2 pages
    targets = [r for r in rows.values() if r["kind"] == "target"]
    assert targets and all(r["verdict"] == "dry run" for r in targets)
    assert any(c.startswith("triton decode b=4") and rows[c]["kind"] == "target" for c in rows)  # the decode target
    assert any(c.startswith("triton mixed 96 tok") for c in rows)
    assert report["ceilings_source"].startswith("measured (this cpu")
    header = [line for line in done.stdout.splitlines() if line.startswith("row ")]
    assert len(header) == 1 and header[0].split() == ["row", "figure", "target", "verdict"]
    assert "GREEN" in done.stdout
    plan = report["sections"]["plan"]["rows"]
    assert [r["check"] for r in plan][:2] == ["GPU floor llama-3-8b decode b=1 ctx=1024",
                                              "GPU floor llama-3-8b decode b=32 ctx=1024"]


def test_bad_arguments_are_refused():
    done = subprocess.run([sys.executable, os.path.join(GPU_DIR, "gpu_check.py"), "--dry-run",
                           "--mixed-tokens", "64", "--mixed-decodes", "64"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "room for a prefill chunk" in done.stderr


@pytest.mark.slow
def test_triton_kernels_compile_for_sm90_without_spills(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / "sm90.json"
    done = subprocess.run([sys.executable, os.path.join(GPU_DIR, "compile_sm90.py"), "--quick", "--json", str(out)],
                          capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    variants = {v["label"].split(" (")[0]: v for v in json.loads(out.read_text())["variants"]}
    assert variants["llama-3-8b prefill chunk"]["matrix_path"] == "wgmma"  # Hopper's matrix instructions
    assert all(v["spill_bytes"] == 0 for v in variants.values())


def test_serve_check_serves_one_chat_on_the_cpu(tmp_path):
    """The run's end-to-end step through its real code on the CPU: serve (tiny random model), one chat, metrics, and
    the same greedy completions with speculation on."""
    out = tmp_path / "serve.json"
    done = subprocess.run([sys.executable, os.path.join(GPU_DIR, "serve_check.py"), "--device", "cpu", "--model", "tiny",
                           "--max-model-len", "512", "--json", str(out)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    sections = json.loads(out.read_text())["sections"]
    rows = sections["serve"]["rows"]
    assert [r["check"] for r in rows] == ["serve ready", "one chat completion", "metrics after the chat"]
    assert all(r["verdict"] == "pass" for r in rows)
    spec = {r["check"]: r for r in sections["speculation"]["rows"]}
    assert spec["greedy identical with speculation"]["verdict"] == "pass"
    assert spec["serve --speculative ngram ready"]["verdict"] == "pass"
