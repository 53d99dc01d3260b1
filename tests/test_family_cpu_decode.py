"""The compiled CPU forward (models/cpu_decode.cpp) on Qwen3 and Gemma 3 models follows the Python forward (logits
and the KV written) over decode-only iterations and over decodes beside a prefill chunk on a cached prefix: Qwen3's
per-head q/k norms before RoPE; Gemma 3's scaled embeddings, four norms a layer, GELU-tanh, query scale, and its
sliding layers' own RoPE base and window (decodes and chunks longer than the window, and a decode within it).

The extension is compiled once per machine (minutes on 2 cores) into the stallfree cache; without a C++ compiler
these tests skip.
"""
from __future__ import annotations

import functools

import pytest
import torch

from model_helpers import make_request, prefill_all_rows, relative_error, step
from stallfree.bench.write_random_gguf import write_family
from stallfree.node_daemon.engine.config import CacheConfig
from stallfree.node_daemon.engine.model_runner import ModelRunner
from stallfree.node_daemon.engine.scheduler_output import ScheduledChunk
from stallfree.node_daemon.models import cpu_decode
from stallfree.node_daemon.models.config import ModelConfig
from stallfree.node_daemon.models.llama import LlamaForCausalLM
from stallfree.node_daemon.models.random_weights import init_random_weights, tiny_family_shape

# Compiled against Python forward on the same bfloat16 model: as tests/test_cpu_decode.py's PATH_TOLERANCE.
PATH_TOLERANCE = 0.03


@pytest.fixture(autouse=True)
def _no_weight_cache(monkeypatch):
    monkeypatch.setenv("STALLFREE_WEIGHT_CACHE", "off")


@functools.lru_cache(maxsize=None)
def _gguf(family: str, root: str, kind: str = "q8_0", head_dim: int | None = None) -> str:
    shape = tiny_family_shape(family)
    model = LlamaForCausalLM(shape.with_(head_dim=head_dim) if head_dim else shape, torch.float32)
    init_random_weights(model, seed=5, norm_std=0.1)
    path = f"{root}/{family}-{kind}{f'-d{head_dim}' if head_dim else ''}.gguf"
    write_family(path, model, kind, tokenizer=False)
    return path


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("family-cpu"))


def _runner(path: str) -> ModelRunner:
    if not cpu_decode.ensure_built(background=False):
        pytest.skip(f"compiled decode path unavailable: {cpu_decode.why_not()}")
    return ModelRunner(ModelConfig(model=path, dtype="bfloat16", compiled_decode="now"),
                       CacheConfig(block_size=16, num_blocks=32), max_num_tokens=256, max_num_seqs=8)


def _python_path(runner: ModelRunner):
    class Off:
        def __enter__(self):
            self.saved, runner.cpu_decode = runner.cpu_decode, None

        def __exit__(self, *exc):
            runner.cpu_decode = self.saved
    return Off()


# Q8_0 (8-bit tiles), Q5_0 (5-bit tiles: the Q4_K_M fallback of rows not a multiple of 256) and F16 (float
# projections: oneDNN's copy or ATen's linear inside the compiled forward); head_dim 256 (Gemma 3's: the decode
# attention kernel's widest rows, windowed on the sliding layers).
@pytest.mark.parametrize("family,kind,head_dim", [("qwen3", "q8_0", None), ("gemma3", "q8_0", None),
                                                  ("gemma3", "q5_0", None), ("qwen3", "f16", None),
                                                  ("gemma3", "q8_0", 256)])
def test_compiled_forward_follows_the_python_forward(family, kind, head_dim, root):
    runner = _runner(_gguf(family, root, kind, head_dim))
    assert runner.cpu_decode is not None, cpu_decode.unsupported(runner.model)
    decodes = []
    for i, n in enumerate((5, 9, 30)):  # Gemma's tiny window is 8: the first decode sees all its keys
        req = make_request(f"d{i}", [(13 * i + 5 * j) % 500 + 3 for j in range(n)], [1 + 3 * i, 2 + 3 * i, 3 + 3 * i])
        with _python_path(runner):
            req.append_output_token(int(prefill_all_rows(runner, req, 16)[-1].argmax()))
        decodes.append(req)
    decode_chunks = [ScheduledChunk(r, r.num_tokens - 1, 1, is_prefill=False, samples=True) for r in decodes]
    prompt = [(17 * j) % 500 + 7 for j in range(60)]
    chunked = make_request("c", prompt, [10, 11, 12, 13])
    with _python_path(runner):
        prefill_all_rows(runner, chunked, 16, start=0)
    # A decode-only iteration, then the decodes beside a 21-token chunk over a 39-token cached prefix (on a sliding
    # layer the chunk's first rows see none of the first 32 keys: the kernel's scores start past them).
    for chunks in (decode_chunks, decode_chunks + [ScheduledChunk(chunked, 39, 21, is_prefill=True, samples=True)]):
        k_cache, _ = runner.kv_caches[0]
        with _python_path(runner):
            want = step(runner, chunks, all_logits=True)
            want_k = k_cache.clone()
        calls = []
        compiled = runner.cpu_decode.forward
        runner.cpu_decode.forward = lambda *args: calls.append(1) or compiled(*args)
        try:
            got = step(runner, chunks, all_logits=True)  # rewrites the same slots
        finally:
            runner.cpu_decode.forward = compiled
        assert calls, "the iteration did not take the compiled forward"
        assert relative_error(got, want) < PATH_TOLERANCE
        assert got.argmax(-1).tolist() == want.argmax(-1).tolist()
        assert relative_error(k_cache, want_k) < PATH_TOLERANCE  # the keys: normed per head, then rotated


def test_qwen2_biases_and_float_projections_take_the_compiled_forward():
    """A Qwen2-style model (q/k/v biases) of random bfloat16 weights: no projection has codes, every one is a float
    weight, and the compiled forward serves it (biases added after the q/k/v projection, as the Python path does)."""
    from stallfree.node_daemon.models.loader import LoadedModel

    if not cpu_decode.ensure_built(background=False):
        pytest.skip(f"compiled decode path unavailable: {cpu_decode.why_not()}")
    shape = tiny_family_shape("qwen3").with_(family="llama", qkv_bias=True)
    model = LlamaForCausalLM(shape, torch.bfloat16)
    init_random_weights(model, seed=3, norm_std=0.1)
    for layer in model.layers:  # biases large enough to matter
        layer.self_attn.qkv_proj.bias.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(1))
    loaded = LoadedModel(model=model, shape=shape, eos_token_ids=(), bos_token_id=None, max_model_len=256,
                         source=None, source_kind="random")
    runner = ModelRunner(ModelConfig(model="qwen2-like", dtype="bfloat16", compiled_decode="now"),
                         CacheConfig(block_size=16, num_blocks=32), max_num_tokens=256, max_num_seqs=8, loaded=loaded)
    assert cpu_decode.unsupported(model) is None and runner.cpu_decode is not None
    req = make_request("q", [(7 * j) % 400 + 3 for j in range(20)], [1, 2])
    chunks = [ScheduledChunk(req, 0, 20, is_prefill=True, samples=True)]
    with _python_path(runner):
        want = step(runner, chunks, all_logits=True)
    calls = []
    compiled = runner.cpu_decode.forward
    runner.cpu_decode.forward = lambda *args: calls.append(1) or compiled(*args)
    try:
        got = step(runner, chunks, all_logits=True)
    finally:
        runner.cpu_decode.forward = compiled
    assert calls and relative_error(got, want) < PATH_TOLERANCE
    assert got.argmax(-1).tolist() == want.argmax(-1).tolist()
