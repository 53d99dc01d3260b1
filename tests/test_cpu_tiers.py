"""One engine for every x86 tier (models/cpu_tier.py): the tier read from the CPU's flags, forced lower by
STALLFREE_CPU_TIER (never higher), and SmolLM2 served at the tiers below AVX-512 from its GGUF codes alone: no oneDNN
copy, no dense copy kept, the compiled forward's decode rows and prefill chunks through the AVX2 (or portable) code
kernel, with the float32 reference's greedy answers and logits within bfloat16's rounding of it.

On an AVX-512 CPU the lower tiers are forced here, so their paths are tested there too; a tier the CPU lacks skips
with its instructions named. Each tier's extension is compiled once per machine into the stallfree cache."""
from __future__ import annotations

import pytest
import torch

from model_helpers import (forced_cpu_tier, greedy_decode, make_request, needs_onednn_bf16, prefill_all_rows,
                           relative_error, smollm2_runner, smollm2_tokenizer)
from stallfree.node_daemon.engine.config import CacheConfig
from stallfree.node_daemon.engine.model_runner import ModelRunner
from stallfree.node_daemon.models import cpu_decode
from stallfree.node_daemon.models.config import ModelConfig
from stallfree.node_daemon.models.cpu_tier import TIERS, _NEEDS, cap_libraries_at_forced_tier, detected_tier, \
    resolve_tier
from stallfree.node_daemon.models.layers import Linear

BF16_LOGIT_TOLERANCE = 0.05  # test_quantized's: bfloat16 activations against the float32 reference

AVX512_BF16 = "flags : fpu sse2 avx2 fma f16c avx512f avx512bw avx512vl avx512dq avx512_bf16 avx512_vnni"
AVX512 = "flags : fpu sse2 avx2 fma f16c avx512f avx512bw avx512vl avx512dq"
ZEN3 = "flags : fpu sse2 avx avx2 fma f16c bmi2"


def test_the_tier_is_read_from_the_flags():
    assert resolve_tier(None, AVX512_BF16).name == "avx512_bf16" and resolve_tier(None, AVX512_BF16).vnni
    assert resolve_tier(None, AVX512).name == "avx512" and not resolve_tier(None, AVX512).vnni
    zen3 = resolve_tier(None, ZEN3)
    assert zen3.name == "avx2" and not zen3.onednn_bf16 and not zen3.bf16_native and not zen3.vnni
    assert resolve_tier(None, "flags : fpu sse2").name == "generic"
    assert "-march=x86-64-v3" in zen3.cflags  # never -march=native: a forced tier compiles only its instructions


def test_a_lower_tier_can_be_forced_and_a_higher_one_is_refused():
    forced = resolve_tier("avx2", AVX512_BF16)
    assert forced.name == "avx2" and forced.forced and "forced" in forced.describe() and not forced.vnni
    with pytest.raises(ValueError, match="needs avx2, fma, f16c, avx512f"):
        resolve_tier("avx512", ZEN3)
    with pytest.raises(ValueError, match="not a tier; use one of generic, avx2"):
        resolve_tier("sse9", ZEN3)


def test_a_forced_tier_caps_torch_and_onednn_unless_they_are_set():
    env = {"STALLFREE_CPU_TIER": "avx2"}
    cap_libraries_at_forced_tier(env)
    assert env["ATEN_CPU_CAPABILITY"] == "avx2" and env["ONEDNN_MAX_CPU_ISA"] == "AVX2"
    env = {"STALLFREE_CPU_TIER": "avx2", "ATEN_CPU_CAPABILITY": "default"}
    cap_libraries_at_forced_tier(env)
    assert env["ATEN_CPU_CAPABILITY"] == "default"
    env = {}
    cap_libraries_at_forced_tier(env)
    assert env == {}


def _tier_runner(tier: str) -> ModelRunner:
    if TIERS.index(tier) > TIERS.index(detected_tier()):
        pytest.skip(f"this CPU lacks the {tier} tier ({', '.join(_NEEDS[tier])})")
    runner = ModelRunner(ModelConfig(model="smollm2-135m", dtype="bfloat16", compiled_decode="now",
                                     release_dense_weights=True),
                         CacheConfig(block_size=16, num_blocks=96), max_num_tokens=512, max_num_seqs=8)
    if runner.cpu_decode is None:
        pytest.skip(f"compiled forward unavailable at {tier}: {cpu_decode.why_not()}")
    return runner


@pytest.mark.parametrize("tier", ["avx2", "generic"])
def test_a_tier_below_avx512_serves_smollm2_from_its_codes(tier):
    tokenizer = smollm2_tokenizer()
    question = tokenizer.encode("The capital of France is")
    passage = tokenizer.encode("The history of the printing press begins in the fifteenth century, when a "
                               "goldsmith in Mainz combined movable metal type with an oil-based ink and")
    reference = smollm2_runner()
    want_answer = tokenizer.decode(greedy_decode(reference, make_request("q", question, [10, 11]),
                                                 prefill_all_rows(reference, make_request("q", question, [10, 11]),
                                                                  len(question))[-1], 6))
    want_rows = prefill_all_rows(reference, make_request("p", passage, [12, 13, 14]), 12)
    with forced_cpu_tier(tier):
        runner = _tier_runner(tier)
        model = runner.model
        projections = [m for m in model.modules() if isinstance(m, Linear)]
        # served from the codes alone: no oneDNN copy, the dense copies and torch's int4 packs released
        assert all(m.packed is None and m.int4 is not None and m.weight.device.type == "meta" for m in projections)
        assert all(m.int4.packed is None and m.int4.tiles is not None for m in projections)
        assert model.tied_lm_head_int4.packed is None
        paths = cpu_decode.paths_taken()
        assert paths["cpu_tier"] == tier and paths["forward"] == "compiled"
        assert paths["matmul"].startswith("avx2" if tier == "avx2" else "portable")
        req = make_request("q", question, [1, 2])
        answer = tokenizer.decode(greedy_decode(runner, req, prefill_all_rows(runner, req, len(question))[-1], 6))
        rows = prefill_all_rows(runner, make_request("p", passage, [3, 4, 5]), 12)  # chunks of 12 over a prefix
    assert answer == want_answer
    assert relative_error(rows, want_rows) < BF16_LOGIT_TOLERANCE
    assert (rows.argmax(-1) == want_rows.argmax(-1)).float().mean() >= 0.9
    assert torch.isfinite(rows).all()


def test_a_released_int4_pack_is_refused_clearly_when_the_code_kernel_is_off():
    import numpy as np

    from stallfree.node_daemon.models.quantized import BlockCodes, Int4Weight

    d = np.full((16, 1), 0.05, dtype=np.float32)
    weight = Int4Weight(BlockCodes(np.full((16, 32), 9, dtype=np.uint8), d, np.zeros_like(d), 1, "Q4_0"),
                        torch.bfloat16)
    x = torch.ones(2, 32, dtype=torch.bfloat16)
    # no code kernel published for it: torch's int4 kernel, its pack made from the tiles at this first use
    assert torch.allclose(weight.matmul(x).float(), torch.full((2, 16), 1.6), rtol=1e-2)  # (9 - 8) * 0.05 * 32
    assert weight.release_int4_pack() > 0 and weight.packed is None
    with pytest.raises(RuntimeError, match="int4 pack was released"):
        weight.matmul(x)


@needs_onednn_bf16()
def test_on_avx512_the_onednn_copies_are_made_only_where_they_pay_and_without_them_the_codes_serve_many_rows(
        monkeypatch):
    """`on` makes SmolLM2's projections' copies (0.21 GB). auto makes them too unless the code kernel's int8 products
    outrun oneDNN's GEMM (VNNI, no AMX) and the compiled forward will serve (then every row count takes the codes,
    no scratch either), or the copies would pass DENSE_COPY_AUTO_BYTES (a 1B model's 2.5 GB): such a model is served
    from its codes at every row count, as `off` serves any, past DEQUANT_MIN_ROWS rows through the dequantized
    scratch and oneDNN's GEMM where int8 does not outrun it. Either way, the copy's products."""
    from stallfree.node_daemon.models import loader
    from stallfree.node_daemon.models.cpu_tier import cpu_tier
    from stallfree.node_daemon.models.loader import load_model
    from stallfree.node_daemon.models.quantized import DEQUANT_MIN_ROWS, int8_switched_on

    def coded(model):
        return [m for m in model.modules() if isinstance(m, Linear) and m.int4 is not None]

    if not cpu_decode._load_or_build(build=True):
        pytest.skip(f"compiled extension unavailable: {cpu_decode.why_not()}")
    int8_faster = cpu_tier().int8_outruns_onednn and int8_switched_on()
    made = load_model(ModelConfig(model="smollm2-135m", dtype="bfloat16", cpu_dense_copy="on")).model
    # the coded tied head takes the code kernel at every row count: no copy of it
    assert all(m.packed is not None for m in coded(made)) and made.tied_lm_head_packed is None
    assert 0.15e9 < made.dense_copy_bytes() < 0.3e9
    auto = load_model(ModelConfig(model="smollm2-135m", dtype="bfloat16", compiled_decode="now")).model
    assert all((m.packed is None) == int8_faster for m in coded(auto))
    # without the compiled forward nothing publishes the code kernel: the copies take the many-row iterations
    python_path = load_model(ModelConfig(model="smollm2-135m", dtype="bfloat16", compiled_decode="off")).model
    assert all(m.packed is not None for m in coded(python_path))
    monkeypatch.setattr(loader, "DENSE_COPY_AUTO_BYTES", 100 << 20)
    for setting in ("auto", "off"):
        codes_only = load_model(ModelConfig(model="smollm2-135m", dtype="bfloat16", cpu_dense_copy=setting)).model
        assert all(m.packed is None for m in coded(codes_only)) and codes_only.tied_lm_head_packed is None
    cpu_decode.publish_code_kernel(codes_only)
    linear = made.layers[3].mlp.gate_up_proj
    twin = codes_only.layers[3].mlp.gate_up_proj
    if int8_faster:
        assert twin.int4.dequantized is None
    else:
        assert twin.int4.dequantized is not None and twin.int4.dequantized[1] == DEQUANT_MIN_ROWS
    for rows in (24, DEQUANT_MIN_ROWS + 32):  # the code kernel; the dequantized scratch, or the code kernel again
        hidden = torch.randn(rows, made.shape.hidden_size, generator=torch.Generator().manual_seed(rows)).bfloat16()
        assert relative_error(twin(hidden), linear(hidden)) < 0.01
    with pytest.raises(ValueError, match="cpu_dense_copy must be auto, on or off"):
        load_model(ModelConfig(model="tiny", dtype="bfloat16", cpu_dense_copy="sometimes"))
