"""Problem sizes of the GPU check: the GPU's, and the dry run's (the same sections, small enough for the Triton
interpreter on two CPU cores). Sizes that a rerun may narrow are gpu_check.py arguments; the dry run's defaults
for those are DRY_RUN_ARGS."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Scale:
    copy_bytes: int  # the bandwidth ceiling's copy, each way
    matmul_n: int  # the matrix-rate ceiling's n x n x n bf16 product
    correctness_shapes: tuple[tuple[str, int, int, int], ...]  # (label, heads, kv_heads, head_dim)
    correctness_cases: str  # which batches.py case set
    pages: tuple[int, ...]
    attention_model: str  # the attention section's head shape
    stream_bytes: int  # one timed replay reads at least this much KV (past the L2)
    fused: dict  # the fused-ops section's sizes
    sweep_limit: int  # launch shapes tried per batch kind


GPU = Scale(
    copy_bytes=2 << 30, matmul_n=8192,  # 2 GiB: far past the 60 MB L2
    correctness_shapes=(("llama-3-8b", 32, 8, 128), ("smollm2-135m", 9, 3, 64)),
    correctness_cases="gpu", pages=(16, 32),
    attention_model="llama-3-8b", stream_bytes=512 << 20,
    fused=dict(hidden=4096, inter=14336, heads=32, kv_heads=8, head_dim=128, vocab=128256, rows=(64, 2048)),
    sweep_limit=5,
)

DRY_RUN = Scale(
    copy_bytes=16 << 20, matmul_n=256,
    correctness_shapes=(("gqa-4 d32", 8, 2, 32), ("gqa-3 d16", 6, 2, 16)),
    correctness_cases="cpu", pages=(16, 32),
    attention_model="tiny", stream_bytes=16 << 10,  # a few layers: the loop over caches runs
    fused=dict(hidden=256, inter=512, heads=4, kv_heads=2, head_dim=32, vocab=1024, rows=(8, 64)),
    sweep_limit=1,
)

# gpu_check.py argument defaults under --dry-run (explicit arguments still win).
# The decode target is judged at --decode-target-batch (64); the dry run shows it at 4 (the interpreter is slow).
DRY_RUN_ARGS = dict(model="tiny", max_model_len=512, decode_batches=[1, 4], decode_target_batch=4, engine_context=32,
                    attn_context=48,
                    mixed_tokens=96, mixed_decodes=8, chunk_prefix=32, reps=1, budget_s=600.0)
