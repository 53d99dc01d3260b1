"""The Llama-family decoder and its parts against straightforward dense float64 re-implementations."""
from __future__ import annotations

import math
import random

import pytest
import torch

from model_helpers import make_request, prefill_all_rows, relative_error, step, tiny_runner
from stallfree.kernels.attention import AttentionMetadata
from stallfree.kernels.torch_reference import TorchReferenceBackend, paged_attention, write_kv
from stallfree.node_daemon.engine.config import CacheConfig
from stallfree.node_daemon.models.config import ModelConfig
from stallfree.node_daemon.engine.model_runner import ModelRunner
from stallfree.node_daemon.models.llama import LlamaForCausalLM
from stallfree.node_daemon.models.loader import LoadedModel
from stallfree.node_daemon.models.random_weights import init_random_weights
from stallfree.node_daemon.models.rope import RotaryEmbedding, inverse_frequencies
from stallfree.shapes import get_shape
from stallfree.node_daemon.engine.scheduler_output import ScheduledChunk


# --- paged attention vs dense ----------------------------------------------------------------------------

def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """One sequence in float64: q [q_len, H, D] are the last q_len of the seq_len positions in k, v [s, KVH, D]."""
    q, k, v = q.double(), k.double(), v.double()
    q_len, num_heads, _ = q.shape
    seq_len, num_kv_heads, _ = k.shape
    out = torch.empty_like(q)
    for h in range(num_heads):
        kv = h // (num_heads // num_kv_heads)  # GQA: consecutive query heads share a KV head
        for i in range(q_len):
            visible = seq_len - q_len + i + 1
            scores = (k[:visible, kv] @ q[i, h]) * scale
            out[i, h] = torch.softmax(scores, dim=0) @ v[:visible, kv]
    return out


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (6, 2), (8, 1)])
def test_paged_attention_matches_dense_float64(num_heads, num_kv_heads):
    rng = random.Random(num_heads)
    torch.manual_seed(num_heads)
    head_dim, block_size, num_blocks = 8, 4, 64
    # Decodes, a chunk over a cached prefix, a whole prompt, a chunk ending mid-block.
    q_lens = [1, 5, 12, 1, 3]
    seq_lens = [9, 17, 12, 1, 6]
    k_cache = torch.zeros(num_blocks, block_size, num_kv_heads, head_dim)
    v_cache = torch.zeros_like(k_cache)
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables, dense_kv, slots = [], [], []
    for s in seq_lens:
        table = [free.pop() for _ in range(-(-s // block_size))]
        tables.append(table)
        k, v = torch.randn(s, num_kv_heads, head_dim), torch.randn(s, num_kv_heads, head_dim)
        dense_kv.append((k, v))
        slots = [table[p // block_size] * block_size + p % block_size for p in range(s)]
        write_kv(k, v, k_cache, v_cache, torch.tensor(slots))
    width = max(map(len, tables))
    metadata = AttentionMetadata(
        query_start_loc=torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        slot_mapping=torch.empty(0, dtype=torch.int64), max_query_len=max(q_lens), max_seq_len=max(seq_lens),
        query_lens_host=q_lens, seq_lens_host=seq_lens, block_size=block_size)
    query = torch.randn(sum(q_lens), num_heads, head_dim)
    scale = head_dim ** -0.5
    got = TorchReferenceBackend().forward(query, k_cache, v_cache, metadata, scale)
    start = 0
    for (k, v), q_len in zip(dense_kv, q_lens):
        want = dense_attention(query[start:start + q_len], k, v, scale)
        torch.testing.assert_close(got[start:start + q_len].double(), want, rtol=1e-5, atol=1e-5)
        start += q_len
    # In float64 end to end the paged path (batched decodes and per-sequence chunks) is the dense one.
    got64 = paged_attention(query.double(), k_cache.double(), v_cache.double(), metadata, scale)
    start = 0
    for (k, v), q_len in zip(dense_kv, q_lens):
        want = dense_attention(query[start:start + q_len], k, v, scale)
        assert relative_error(got64[start:start + q_len], want) < 1e-12
        start += q_len


def test_write_kv_skips_negative_slots():
    k_cache = torch.zeros(2, 4, 1, 2)
    v_cache = torch.zeros_like(k_cache)
    key = torch.ones(3, 1, 2)
    write_kv(key, key * 2, k_cache, v_cache, torch.tensor([5, -1, 0]))
    assert k_cache[1, 1].eq(1).all() and v_cache[1, 1].eq(2).all() and k_cache[0, 0].eq(1).all()
    assert k_cache.sum() == 4  # two slots of two values, the -1 row written nowhere


# --- RoPE -------------------------------------------------------------------------------------------------

def test_rope_rotation_depends_only_on_relative_position():
    rope = RotaryEmbedding(16, 256, 10000.0, None)
    q, k = torch.randn(1, 1, 16, dtype=torch.float64), torch.randn(1, 1, 16, dtype=torch.float64)

    def score(m: int, n: int) -> float:
        qm, _ = rope(torch.tensor([m]), q, q)
        _, kn = rope(torch.tensor([n]), k, k)
        return float((qm * kn).sum())

    assert score(10, 3) == pytest.approx(score(107, 100), rel=1e-5)
    assert score(10, 3) != pytest.approx(score(10, 4), rel=1e-3)
    # A rotation keeps the norm.
    rotated, _ = rope(torch.tensor([77]), q, q)
    assert rotated.norm() == pytest.approx(float(q.norm()), rel=1e-6)


def test_rope_halves_convention():
    """Hugging Face's rotate_half: pair i is (x[i], x[i + D/2]) rotated by position * inv_freq[i]."""
    rope = RotaryEmbedding(4, 16, 100.0, None)
    x = torch.tensor([[[1.0, 2.0, 3.0, 4.0]]], dtype=torch.float64)
    out, _ = rope(torch.tensor([5]), x, x)
    inv = [1.0, 100.0 ** -0.5]
    want = [1.0 * math.cos(5 * inv[0]) - 3.0 * math.sin(5 * inv[0]), 2.0 * math.cos(5 * inv[1]) - 4.0 * math.sin(5 * inv[1]),
            3.0 * math.cos(5 * inv[0]) + 1.0 * math.sin(5 * inv[0]), 4.0 * math.cos(5 * inv[1]) + 2.0 * math.sin(5 * inv[1])]
    torch.testing.assert_close(out.flatten(), torch.tensor(want, dtype=torch.float64), rtol=1e-6, atol=1e-6)


def test_rope_linear_scaling_divides_frequencies():
    base = inverse_frequencies(64, 10000.0, None)
    torch.testing.assert_close(inverse_frequencies(64, 10000.0, {"type": "linear", "factor": 4.0}), base / 4)


def test_rope_llama3_scaling_bands():
    cfg = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 8192}
    base = inverse_frequencies(128, 500000.0, None)
    scaled = inverse_frequencies(128, 500000.0, cfg)
    wavelen = 2 * math.pi / base
    high = wavelen < 8192 / 4.0  # short wavelengths: kept
    low = wavelen > 8192 / 1.0  # long wavelengths: stretched by the factor
    mid = ~high & ~low
    assert high.any() and low.any() and mid.any()
    torch.testing.assert_close(scaled[high], base[high])
    torch.testing.assert_close(scaled[low], base[low] / 8.0)
    assert ((scaled[mid] < base[mid]) & (scaled[mid] > base[mid] / 8.0)).all()


def test_rope_unknown_scaling_is_a_clear_error():
    with pytest.raises(ValueError, match="unsupported rope_scaling type 'yarn'"):
        inverse_frequencies(64, 10000.0, {"rope_type": "yarn", "factor": 4.0})


# --- the whole decoder vs a dense float64 re-implementation -----------------------------------------------

def dense_llama_logits(model: LlamaForCausalLM, token_ids: list[int]) -> torch.Tensor:
    """All-row logits of one prompt, written out plainly from the Hugging Face-named weights, in float64."""
    shape = model.shape
    w = {name: t.double() for name, t in model.hf_weights()}
    n, d = len(token_ids), shape.head_dim

    def rms(x, weight):
        return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + shape.rms_norm_eps) * weight

    def rope(x):  # [n, heads, d]
        inv = 1.0 / shape.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
        ang = torch.arange(n, dtype=torch.float64)[:, None] * inv[None]
        cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]
        rotated = torch.cat([-x[..., d // 2:], x[..., :d // 2]], -1)
        return x * cos + rotated * sin

    h = w["model.embed_tokens.weight"][token_ids]
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    for i in range(shape.num_layers):
        p = f"model.layers.{i}."
        x = rms(h, w[p + "input_layernorm.weight"])
        proj = {}
        for name in ("q", "k", "v"):
            y = x @ w[p + f"self_attn.{name}_proj.weight"].T
            if shape.qkv_bias:
                y = y + w[p + f"self_attn.{name}_proj.bias"]
            proj[name] = y.view(n, -1, d)
        q, k, v = rope(proj["q"]), rope(proj["k"]), proj["v"]
        group = shape.num_heads // shape.num_kv_heads
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(d)
        att = torch.softmax(scores.masked_fill(~causal, float("-inf")), -1)
        o = torch.einsum("hqk,khd->qhd", att, v).reshape(n, -1)
        h = h + o @ w[p + "self_attn.o_proj.weight"].T
        x = rms(h, w[p + "post_attention_layernorm.weight"])
        gate, up = x @ w[p + "mlp.gate_proj.weight"].T, x @ w[p + "mlp.up_proj.weight"].T
        h = h + (torch.nn.functional.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
    h = rms(h, w["model.norm.weight"])
    head = w["model.embed_tokens.weight"] if shape.tie_word_embeddings else w["lm_head.weight"]
    return h @ head.T


@pytest.mark.parametrize("variant", ["tiny", "tied", "qwen2_bias", "mha"])
def test_decoder_matches_dense_reference(variant):
    shape = get_shape("tiny")
    shape = {"tiny": shape, "tied": shape.with_(tie_word_embeddings=True),
             "qwen2_bias": shape.with_(qkv_bias=True, tie_word_embeddings=True, rope_theta=1e6),
             "mha": shape.with_(num_kv_heads=4, rope_theta=500.0)}[variant]
    model = LlamaForCausalLM(shape, torch.float32, "cpu", max_positions=128)
    init_random_weights(model, seed=11)
    prompt = [random.Random(5).randrange(shape.vocab_size) for _ in range(21)]
    runner = _runner_for(model)
    got = prefill_all_rows(runner, make_request("r", prompt, [3, 0]), chunk_size=21)
    want = dense_llama_logits(model, prompt)
    assert relative_error(got, want) < 1e-5


def test_qkv_bias_changes_the_output():
    shape = get_shape("tiny").with_(qkv_bias=True)
    model = LlamaForCausalLM(shape, torch.float32, "cpu", max_positions=64)
    init_random_weights(model, seed=1)
    runner = _runner_for(model)
    prompt = list(range(10, 30))
    with_bias = prefill_all_rows(runner, make_request("a", prompt, [0, 1]), 20)
    for layer in model.layers:
        layer.self_attn.qkv_proj.bias.zero_()
    without = prefill_all_rows(runner, make_request("b", prompt, [2, 3]), 20)
    assert relative_error(with_bias, without) > 1e-2


def test_logits_only_for_sampling_rows():
    runner = tiny_runner(num_blocks=16)
    a = make_request("a", list(range(1, 20)), [0, 1])
    b = make_request("b", list(range(40, 70)), [2, 3])
    chunks = [ScheduledChunk(a, 0, 19, True, True), ScheduledChunk(b, 0, 16, True, False)]
    sampled = step(runner, chunks)
    assert sampled.shape == (1, runner.loaded.shape.vocab_size) and sampled.dtype == torch.float32
    every = step(runner, chunks, all_logits=True)
    assert every.shape[0] == 35
    torch.testing.assert_close(sampled[0], every[18])


def test_weight_loading_rejects_wrong_shapes_and_missing_weights():
    model = LlamaForCausalLM(get_shape("tiny"), torch.float32, "cpu", max_positions=64)
    weights = dict(model.hf_weights())
    bad = dict(weights)
    bad["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match="k_proj.weight: expected shape"):
        model.load_weights(bad.items())
    partial = {k: v for k, v in weights.items() if "layers.1.mlp.up_proj" not in k}
    with pytest.raises(ValueError, match="lacks 1 weights, e.g. model.layers.1.mlp.up_proj.weight"):
        model.load_weights(partial.items())
    with pytest.raises(ValueError, match="unexpected weight 'model.layers.0.self_attn.q_proj.bias'"):
        model.load_weights([("model.layers.0.self_attn.q_proj.bias", torch.zeros(64))])


def _runner_for(model: LlamaForCausalLM) -> ModelRunner:
    loaded = LoadedModel(model=model, shape=model.shape, eos_token_ids=(), bos_token_id=None, max_model_len=128,
                         source=None, source_kind="random")
    return ModelRunner(ModelConfig(model="tiny"), CacheConfig(block_size=16, num_blocks=16), max_num_tokens=256,
                       max_num_seqs=4, loaded=loaded)
