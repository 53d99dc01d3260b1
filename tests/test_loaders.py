"""load_model's dispatch, the Hugging Face folder and GGUF loaders, random weights; SmolLM2 says Paris."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from hf_folder_writer import save_hf_folder
from model_helpers import (ENGLISH_PASSAGE, greedy_decode, make_request, prefill_all_rows, relative_error,
                           needs_onednn_bf16, smollm2_runner, smollm2_tokenizer)
from stallfree.node_daemon.engine.config import CacheConfig
from stallfree.node_daemon.models.config import ModelConfig
from stallfree.node_daemon.engine.model_runner import ModelRunner
from stallfree.node_daemon.models.gguf_loader import embedded_gguf_path, unpermute_rope_rows
from stallfree.node_daemon.models.llama import LlamaForCausalLM
from stallfree.node_daemon.models.loader import LoadedModel, load_model
from stallfree.node_daemon.models.random_weights import init_random_weights
from stallfree.shapes import SHAPES, get_shape

PROMPT = [7, 300, 42, 42, 9, 511, 0, 64, 128, 256, 3, 17, 99, 150, 200, 250, 301, 302, 303]


def _logits(loaded: LoadedModel, prompt: list[int] = PROMPT) -> torch.Tensor:
    runner = ModelRunner(ModelConfig(), CacheConfig(block_size=16, num_blocks=8), max_num_tokens=256,
                         max_num_seqs=2, loaded=loaded)
    blocks = list(range(7, 7 - -(-len(prompt) // 16), -1))  # a reversed block table
    return prefill_all_rows(runner, make_request("r", prompt, blocks), chunk_size=len(prompt))


def _random(shape_name: str = "tiny", seed: int = 0, **changes) -> LoadedModel:
    shape = get_shape(shape_name).with_(**changes) if changes else get_shape(shape_name)
    model = LlamaForCausalLM(shape, torch.float32, "cpu", max_positions=256)
    init_random_weights(model, seed)
    return LoadedModel(model=model, shape=shape, eos_token_ids=(), bos_token_id=None, max_model_len=256,
                       source=None, source_kind="random")


# --- dispatch and random weights --------------------------------------------------------------------

def test_shape_name_gives_seeded_random_weights():
    a = load_model(ModelConfig(model="tiny", seed=3))
    b = load_model(ModelConfig(model="TINY", seed=3))
    c = load_model(ModelConfig(model="random:tiny", seed=4))
    assert a.source_kind == "random" and a.source is None and a.shape == SHAPES["tiny"]
    assert a.max_model_len == SHAPES["tiny"].max_position_embeddings
    for (name, wa), (_, wb), (_, wc) in zip(a.model.hf_weights(), b.model.hf_weights(), c.model.hf_weights()):
        assert torch.equal(wa, wb), name
        if wa.dim() == 2:
            assert not torch.equal(wa, wc), name


def test_unknown_model_is_a_clear_error():
    with pytest.raises(ValueError, match=r"unknown model 'gpt-17'.*smollm2-135m.*llama-3-8b.*tiny"):
        load_model(ModelConfig(model="gpt-17"))
    with pytest.raises(ValueError, match="unknown model shape 'nope'"):
        load_model(ModelConfig(model="random:nope"))


def test_bad_dtype_device_and_context_are_clear_errors():
    with pytest.raises(ValueError, match="unsupported dtype 'float8'"):
        load_model(ModelConfig(model="tiny", dtype="float8"))
    with pytest.raises(ValueError, match="unsupported device"):
        load_model(ModelConfig(model="tiny", device="mps"))
    with pytest.raises(ValueError, match="max_model_len 4096 exceeds the context of tiny"):
        load_model(ModelConfig(model="tiny", max_model_len=4096))
    assert load_model(ModelConfig(model="tiny", max_model_len=100)).max_model_len == 100


def test_a_model_too_big_for_memory_is_refused_before_allocating():
    with pytest.raises(ValueError, match=r"llama-3-70b needs 2\d\d\.\d GiB of weights in float32 but only"):
        load_model(ModelConfig(model="llama-3-70b"))


def test_auto_dtype_on_cpu_is_bfloat16_where_the_cpu_has_it_and_bfloat16_runs(monkeypatch):
    import stallfree.node_daemon.models.loader as loader

    monkeypatch.setattr(loader, "cpu_has_bf16", lambda: False)
    assert load_model(ModelConfig(model="tiny", dtype="auto")).dtype == torch.float32
    monkeypatch.setattr(loader, "cpu_has_bf16", lambda: True)
    assert load_model(ModelConfig(model="tiny", dtype="auto")).dtype == torch.bfloat16
    bf16 = load_model(ModelConfig(model="tiny", dtype="bfloat16", seed=0))
    f32 = load_model(ModelConfig(model="tiny", dtype="float32", seed=0))
    # Same draw, rounded: bfloat16 logits follow float32's within bfloat16's precision.
    assert relative_error(_logits(bf16), _logits(f32)) < 0.1


# --- Hugging Face folders ----------------------------------------------------------------------------

def test_hf_folder_round_trip_with_sharded_safetensors(tmp_path):
    original = _random(seed=1)
    folder = tmp_path / "tiny-llama"
    save_hf_folder(original.model, str(folder), max_shard_bytes=60_000,
                   extra_config={"eos_token_id": 2, "bos_token_id": 1})
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 5]}))
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 3 and all((folder / s).is_file() for s in shards)

    loaded = load_model(ModelConfig(model=str(folder)))
    assert loaded.source_kind == "hf" and loaded.source == str(folder)
    assert loaded.shape.with_(name="tiny") == original.shape
    assert loaded.eos_token_ids == (2, 5) and loaded.bos_token_id == 1
    torch.testing.assert_close(_logits(loaded), _logits(original), rtol=0, atol=0)


def test_hf_qwen2_folder_round_trip_carries_qkv_bias(tmp_path):
    original = _random(seed=2, qkv_bias=True, tie_word_embeddings=True)
    save_hf_folder(original.model, str(tmp_path), model_type="qwen2")
    assert (tmp_path / "model.safetensors").is_file()
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == "qwen2" and config["tie_word_embeddings"] is True
    loaded = load_model(ModelConfig(model=str(tmp_path)))
    assert loaded.shape.qkv_bias and loaded.model.lm_head is None
    assert loaded.model.layers[1].self_attn.qkv_proj.bias.abs().sum() > 0
    torch.testing.assert_close(_logits(loaded), _logits(original), rtol=0, atol=0)


def test_hf_folder_errors_name_the_problem(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="has no config.json"):
        load_model(ModelConfig(model=str(empty)))
    folder = tmp_path / "m"
    save_hf_folder(_random().model, str(folder), max_shard_bytes=60_000)
    os.remove(next(folder.glob("model-00002-*.safetensors")))
    with pytest.raises(ValueError, match="shards that are missing: model-00002-of"):
        load_model(ModelConfig(model=str(folder)))
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "gpt_neox", "architectures": []}))
    with pytest.raises(ValueError, match="model type 'gpt_neox' is not supported"):
        load_model(ModelConfig(model=str(folder)))


def test_hf_mistral_sliding_window_caps_the_context(tmp_path):
    save_hf_folder(_random().model, str(tmp_path), model_type="mistral", extra_config={"sliding_window": 512})
    assert load_model(ModelConfig(model=str(tmp_path))).max_model_len == 512


def test_hf_llama3_rope_scaling_is_read(tmp_path):
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
    original = _random(rope_scaling=scaling)
    save_hf_folder(original.model, str(tmp_path))
    loaded = load_model(ModelConfig(model=str(tmp_path)))
    assert loaded.shape.rope_scaling == scaling
    long_prompt = list(range(100, 200))  # past the original context, where the scaling matters
    torch.testing.assert_close(_logits(loaded, long_prompt), _logits(original, long_prompt), rtol=0, atol=0)
    plain = _random()
    assert relative_error(_logits(plain, long_prompt), _logits(original, long_prompt)) > 1e-3


# --- GGUF ---------------------------------------------------------------------------------------------

def llama_cpp_permute(weights: torch.Tensor, n_head: int) -> torch.Tensor:
    """convert_hf_to_gguf.py's LlamaModel.permute, verbatim in torch."""
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def test_unpermute_inverts_llama_cpp_permute():
    w = torch.randn(3 * 8, 5)
    torch.testing.assert_close(unpermute_rope_rows(llama_cpp_permute(w, 3), 3), w, rtol=0, atol=0)
    b = torch.randn(2 * 16)
    torch.testing.assert_close(unpermute_rope_rows(llama_cpp_permute(b, 2), 2), b, rtol=0, atol=0)


def _write_gguf(loaded: LoadedModel, path: str, arch: str = "llama") -> None:
    """Write a model as llama.cpp's converter would: GGUF names, Q/K permuted for `llama`, one Q8_0 tensor."""
    import gguf

    shape = loaded.shape
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(shape.num_layers)
    w.add_context_length(shape.max_position_embeddings)
    w.add_embedding_length(shape.hidden_size)
    w.add_feed_forward_length(shape.intermediate_size)
    w.add_head_count(shape.num_heads)
    w.add_head_count_kv(shape.num_kv_heads)
    w.add_rope_freq_base(shape.rope_theta)
    w.add_layer_norm_rms_eps(shape.rms_norm_eps)
    w.add_rope_dimension_count(shape.head_dim)
    w.add_vocab_size(shape.vocab_size)
    w.add_eos_token_id(7)
    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    for name, t in loaded.model.hf_weights():
        t = t.clone()
        if name == "model.embed_tokens.weight":
            gguf_name = "token_embd.weight"
        elif name == "model.norm.weight":
            gguf_name = "output_norm.weight"
        elif name == "lm_head.weight":
            gguf_name = "output.weight"
        else:
            _, _, layer, rest = name.split(".", 3)
            part, kind = rest.rsplit(".", 1)
            gguf_name = f"blk.{layer}.{names[part]}.{kind}"
            if arch == "llama" and part == "self_attn.q_proj":
                t = llama_cpp_permute(t, shape.num_heads)
            elif arch == "llama" and part == "self_attn.k_proj":
                t = llama_cpp_permute(t, shape.num_kv_heads)
        array = t.numpy().astype(np.float32)
        if gguf_name == "blk.0.ffn_down.weight":
            quantised = gguf.quants.quantize(array, gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(gguf_name, quantised, raw_shape=quantised.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            # The reference model gets the same rounding the file got.
            deq = gguf.quants.dequantize(quantised, gguf.GGMLQuantizationType.Q8_0)
            loaded.model.layers[0].mlp.down_proj.weight.copy_(torch.from_numpy(deq))
        else:
            w.add_tensor(gguf_name, array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_gguf_file_round_trip_undoes_the_qk_permutation(tmp_path):
    original = _random(seed=5)
    path = str(tmp_path / "tiny.gguf")
    _write_gguf(original, path)
    loaded = load_model(ModelConfig(model=path))
    assert loaded.source_kind == "gguf" and loaded.source == path and loaded.eos_token_ids == (7,)
    assert loaded.shape.num_kv_heads == 2 and not loaded.shape.tie_word_embeddings
    assert relative_error(_logits(loaded), _logits(original)) < 1e-6


def test_gguf_qwen2_file_keeps_qk_rows_and_reads_the_bias(tmp_path):
    original = _random(seed=6, qkv_bias=True, tie_word_embeddings=True)
    path = str(tmp_path / "tiny-qwen2.gguf")
    _write_gguf(original, path, arch="qwen2")
    loaded = load_model(ModelConfig(model=path))
    assert loaded.shape.qkv_bias and loaded.shape.tie_word_embeddings
    assert relative_error(_logits(loaded), _logits(original)) < 1e-6


def test_embedded_smollm2_loads_with_its_shape():
    loaded = smollm2_runner().loaded
    assert loaded.source == embedded_gguf_path() and loaded.source_kind == "gguf"
    assert loaded.shape.with_(rms_norm_eps=1e-5) == SHAPES["smollm2-135m"]
    assert loaded.eos_token_ids == (2,) and loaded.max_model_len == 8192
    assert loaded.model.lm_head is None  # tied embeddings


def test_smollm2_greedy_continuation_says_paris():
    runner = smollm2_runner()
    tokenizer = smollm2_tokenizer()
    prompt = tokenizer.encode("The capital of France is")
    req = make_request("paris", prompt, [60, 61])
    last = prefill_all_rows(runner, req, chunk_size=len(prompt))[-1]
    text = tokenizer.decode(greedy_decode(runner, req, last, 3))
    assert " Paris" in text, text


def test_smollm2_predicts_english_prose_well():
    """Mean next-token loss on a plain English passage: 2.7 nats with the Q/K rows un-permuted, 4.2 without
    (a short prompt's answer survives the mistake; a 40-token passage's loss does not)."""
    runner = smollm2_runner()
    ids = smollm2_tokenizer().encode(ENGLISH_PASSAGE)
    logits = prefill_all_rows(runner, make_request("prose", ids, [56, 57, 58, 59]), chunk_size=len(ids))
    log_probs = torch.log_softmax(logits[:-1].double(), dim=-1)
    mean_nll = -log_probs[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].mean()
    assert mean_nll < 3.3


@needs_onednn_bf16()
def test_cpu_bfloat16_models_prepack_dense_weights_with_the_same_logits():
    import torch

    from stallfree.node_daemon.models.config import ModelConfig
    from stallfree.node_daemon.models.layers import Linear
    from stallfree.node_daemon.models.loader import load_model

    model = load_model(ModelConfig(model="tiny", dtype="bfloat16")).model
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert linears and all(m.packed is not None for m in linears)
    hidden = torch.randn(24, model.shape.hidden_size, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    packed = [m(hidden[:, :m.in_features]) for m in linears[:3]] + [model.compute_logits(hidden)]
    for m in linears:
        m.packed = None
    model.tied_lm_head_packed = None
    dense = [m(hidden[:, :m.in_features]) for m in linears[:3]] + [model.compute_logits(hidden)]
    assert all(torch.equal(a, b) for a, b in zip(packed, dense))
    # New weights re-pack: the packed copies never serve stale values.
    model.prepack_for_cpu()
    model.load_weights((name, torch.zeros_like(w)) for name, w in model.hf_weights())
    assert all(m.packed is not None for m in linears)
    assert torch.count_nonzero(linears[0](hidden[:, :linears[0].in_features])) == 0
    assert not load_model(ModelConfig(model="tiny", dtype="float32")).model.layers[0].mlp.down_proj.packed
