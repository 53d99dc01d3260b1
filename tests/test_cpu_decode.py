"""The compiled forward (models/cpu_decode.cpp) against the Python forward it replaces and the float32 reference:
logits and KV writes within bfloat16 rounding of the Python path's, the same greedy answers as float32, for
decode-only iterations and for mixed ones (decodes plus prefill chunks over a cached prefix); the runner takes it
for decode-only iterations of at most max_rows rows and for iterations with a prefill chunk.

The extension is compiled once per machine (about a minute on 2 cores) into the stallfree cache and loaded from it
afterwards; without a C++ compiler these tests skip.
"""
from __future__ import annotations

import functools

import pytest
import torch

from model_helpers import greedy_decode, make_request, prefill_all_rows, relative_error, smollm2_runner, \
    smollm2_tokenizer, step
from stallfree.node_daemon.engine.config import CacheConfig
from stallfree.node_daemon.engine.model_runner import ModelRunner
from stallfree.node_daemon.engine.scheduler_output import ScheduledChunk
from stallfree.node_daemon.models import cpu_decode
from stallfree.node_daemon.models.config import ModelConfig

# Compiled against Python forward, same bfloat16 model: the loops round where the ops do, but sum in another
# order (measured 0.009 of the logits' range on SmolLM2); float32 reference: test_quantized's tolerance.
PATH_TOLERANCE = 0.03
BF16_LOGIT_TOLERANCE = 0.05
# Where iterations past a few rows take the code kernel with int8 activations on both paths (no oneDNN copies, or a
# CPU without AMX, where the codes take decode iterations of up to 64 rows: cpu_decode.code_max_rows), a small difference in a layer's input rounds some activations to the next int8 step,
# and that compounds over 30 layers: measured 0.039 on a forced AVX2 tier.
INT8_PATH_TOLERANCE = 0.08


def _path_tolerance() -> float:
    from stallfree.node_daemon.models.cpu_tier import cpu_tier
    from stallfree.node_daemon.models.quantized import CODE_MAX_ROWS

    int8 = cpu_decode.int8_min_rows() and (cpu_decode.code_max_rows() > CODE_MAX_ROWS or not cpu_tier().onednn_bf16)
    return INT8_PATH_TOLERANCE if int8 else PATH_TOLERANCE


@functools.lru_cache(maxsize=None)
def _runner() -> ModelRunner:
    if not cpu_decode.ensure_built(background=False):
        pytest.skip(f"compiled decode path unavailable: {cpu_decode.why_not()}")
    runner = ModelRunner(ModelConfig(model="smollm2-135m", dtype="bfloat16", compiled_decode="now"),
                         CacheConfig(block_size=16, num_blocks=192), max_num_tokens=512, max_num_seqs=16)
    assert runner.cpu_decode is not None
    return runner


def _python_path(runner: ModelRunner):
    class Off:
        def __enter__(self):
            self.saved, runner.cpu_decode = runner.cpu_decode, None

        def __exit__(self, *exc):
            runner.cpu_decode = self.saved
    return Off()


def _decode_chunks(reqs):
    return [ScheduledChunk(r, r.num_tokens - 1, 1, is_prefill=False, samples=True) for r in reqs]


# Ragged lengths (int4 projections); a long one across many blocks; 12 rows: the oneDNN bfloat16 projections.
@pytest.mark.parametrize("lengths", [(7, 21, 40), (300,), tuple(range(5, 65, 5))])
def test_compiled_decode_follows_the_python_forward(lengths):
    runner = _runner()
    reqs, next_block = [], 1
    for i, n in enumerate(lengths):
        count = -(-(n + 1) // 16)
        blocks, next_block = list(range(next_block, next_block + count)), next_block + count
        req = make_request(f"ab{n}", [(31 * i + 7 * j) % 5000 + 20 for j in range(n)], blocks)
        last = prefill_all_rows(runner, req, 64)[-1]
        req.append_output_token(int(last.argmax()))
        reqs.append(req)
    assert next_block <= 60  # clear of the blocks the other tests use
    k_cache, v_cache = runner.kv_caches[0]  # the first layer: same inputs on both paths
    slots = [r.block_ids[(r.num_tokens - 1) // 16] * 16 + (r.num_tokens - 1) % 16 for r in reqs]
    with _python_path(runner):
        want = step(runner, _decode_chunks(reqs))
        want_k, want_v = k_cache.flatten(1, 2)[:, slots].clone(), v_cache.flatten(1, 2)[:, slots].clone()
    got = step(runner, _decode_chunks(reqs))  # rewrites the same slots
    got_k, got_v = k_cache.flatten(1, 2)[:, slots], v_cache.flatten(1, 2)[:, slots]
    # 12 rows take int8 activations into the LM head (and, without oneDNN copies for them, the projections) where
    # the tier has int8 products
    int8_head = cpu_decode.int8_min_rows() and len(lengths) >= cpu_decode.int8_min_rows()
    assert relative_error(got, want) < (INT8_PATH_TOLERANCE if int8_head else PATH_TOLERANCE)
    assert got.argmax(-1).tolist() == want.argmax(-1).tolist()
    assert relative_error(got_k, want_k) < PATH_TOLERANCE and torch.equal(got_v, want_v)  # v is copied as is


@pytest.mark.parametrize("question", ["The capital of France is", "Water is made of hydrogen and"])
def test_compiled_decode_gives_the_float32_greedy_answers(question):
    tokenizer = smollm2_tokenizer()
    ids = tokenizer.encode(question)
    answers = []
    for runner, blocks in ((smollm2_runner(), [60, 61]), (_runner(), [80, 81])):
        req = make_request("q", ids, blocks)
        last = prefill_all_rows(runner, req, len(ids))[-1]
        answers.append(tokenizer.decode(greedy_decode(runner, req, last, 6)))
    assert answers[0] == answers[1], answers


def test_compiled_decode_logits_follow_float32():
    ids = smollm2_tokenizer().encode("The history of the printing press begins in the fifteenth century, when")
    rows = []
    for runner, blocks in ((smollm2_runner(), [62, 63]), (_runner(), [82, 83])):
        req = make_request("f", ids[:-1], blocks)
        prefill_all_rows(runner, req, len(ids) - 1)
        req.append_output_token(ids[-1])
        rows.append(step(runner, _decode_chunks([req])))
    assert relative_error(rows[1], rows[0]) < BF16_LOGIT_TOLERANCE


def test_which_iterations_take_the_compiled_path(monkeypatch):
    runner = _runner()
    calls = []
    real = runner.cpu_decode.forward
    monkeypatch.setattr(runner.cpu_decode, "forward", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    reqs = [make_request(f"few{i}", list(range(40 + i, 50 + i)), [84 + i]) for i in range(10)]
    for r in reqs:
        r.num_computed_tokens = r.num_tokens - 1
    step(runner, _decode_chunks(reqs[:8]))  # int4 projections
    step(runner, _decode_chunks(reqs))  # 10 rows: the oneDNN bfloat16 ones
    assert calls == [8, 10]
    mixed = [ScheduledChunk(reqs[0], reqs[0].num_tokens - 1, 1, is_prefill=False, samples=True),
             ScheduledChunk(reqs[1], 0, reqs[1].num_tokens, is_prefill=True, samples=True)]
    step(runner, mixed)  # a decode beside a chunk: compiled too
    assert calls == [8, 10, 11]
    monkeypatch.setattr(runner.cpu_decode, "max_rows", 8)
    step(runner, _decode_chunks(reqs))  # a decode-only batch past max_rows: the Python forward
    monkeypatch.setattr(runner.cpu_decode, "mixed", False)  # STALLFREE_CPU_MIXED=0
    step(runner, mixed)
    assert calls == [8, 10, 11]


def _filled(runner, name: str, ids: list[int], first_block: int):
    """A request whose tokens all have KV (prefilled by the Python path), with its next token appended."""
    blocks = list(range(first_block, first_block + -(-(len(ids) + 40) // 16)))
    req = make_request(name, ids, blocks)
    with _python_path(runner):
        last = prefill_all_rows(runner, req, 64)[-1]
    req.append_output_token(int(last.argmax()))
    return req


# A decode beside a chunk over a cached prefix (int4: 6 rows; oneDNN past 8), two chunks in one iteration, a
# whole prompt as one chunk beside decodes.
@pytest.mark.parametrize("shape", ["small", "prefix", "two_chunks", "whole_prompt"])
def test_compiled_mixed_iteration_follows_the_python_forward(shape):
    runner = _runner()
    decodes = [_filled(runner, f"d{shape}{i}", [(13 * i + 5 * j) % 4000 + 30 for j in range(9 + 23 * i)],
                       100 + 8 * i) for i in range(3)]
    prompt = [(17 * j) % 4000 + 40 for j in range(150)]
    start, size = {"small": (140, 5), "prefix": (37, 100), "two_chunks": (64, 48), "whole_prompt": (0, 150)}[shape]
    chunked = make_request(f"c{shape}", prompt, list(range(130, 141)))
    if start:
        with _python_path(runner):
            prefill_all_rows(runner, chunked, 64, start=0)
    chunks = _decode_chunks(decodes[:1] if shape == "small" else decodes)
    chunks.append(ScheduledChunk(chunked, start, size, is_prefill=True, samples=start + size == len(prompt)))
    if shape == "two_chunks":
        other = make_request("c2", prompt[:70], list(range(150, 156)))
        chunks.append(ScheduledChunk(other, 0, 70, is_prefill=True, samples=True))
    with _python_path(runner):
        want = step(runner, chunks, all_logits=True)
    got = step(runner, chunks, all_logits=True)  # rewrites the same slots
    assert got.shape == want.shape
    assert relative_error(got, want) < _path_tolerance()
    # Greedy picks agree but where two tokens are within rounding of each other (prompt rows of made-up text).
    picked = got.argmax(-1)
    scale = want.abs().max()
    shortfall = (want.max(-1).values - want.gather(1, picked[:, None])[:, 0]) / scale
    print(f"relative error {relative_error(got, want):.4f}, rows picking another token {int((shortfall > 0).sum())} of "
          f"{len(picked)}, largest shortfall {float(shortfall.max()):.4f}")
    assert float(shortfall.max()) < _path_tolerance() / 3


def test_compiled_chunked_prefill_gives_the_float32_greedy_answer():
    """A prompt prefilled in chunks of 7 beside a running decode, then decoded, all on the compiled path."""
    tokenizer = smollm2_tokenizer()
    ids = tokenizer.encode("The capital of France is")
    float32 = smollm2_runner()
    ref = make_request("ref", ids, [60, 61])
    want = tokenizer.decode(greedy_decode(float32, ref, prefill_all_rows(float32, ref, len(ids))[-1], 6))
    runner = _runner()
    other = _filled(runner, "beside", [(3 * j) % 3000 + 50 for j in range(30)], 160)
    req = make_request("q", ids, [170, 171])
    pos = 0
    while pos < len(ids):
        n = min(7, len(ids) - pos)
        chunks = _decode_chunks([other]) + [ScheduledChunk(req, pos, n, is_prefill=True, samples=pos + n == len(ids))]
        logits = step(runner, chunks)
        other.append_output_token(int(logits[0].argmax()))
        other.num_computed_tokens = other.num_tokens - 1
        pos += n
    req.num_computed_tokens = len(ids)
    assert tokenizer.decode(greedy_decode(runner, req, logits[-1], 6)) == want


def test_models_it_does_not_cover_say_why():
    float32 = smollm2_runner()
    assert "bfloat16" in cpu_decode.unsupported(float32.model)
    assert float32.cpu_decode is None  # compiled_decode defaults to off


def test_the_library_runs_on_torchs_threads_and_keeps_its_build_key():
    """The kernels' at::parallel_for is OpenMP pragmas in ATen's headers: a library built without -fopenmp ran them
    on one thread (half the cores on a 2-core machine). It must need torch's libgomp, and a build must leave the
    build key as it was (cpp_extension.load appends to the flag lists it is given: a changed key meant a second
    build of the same tier, whose namespace then aborted the process as it loaded)."""
    import subprocess

    from stallfree.node_daemon.models.cpu_tier import cpu_tier

    _runner()
    tier = cpu_tier()
    library = cpu_decode._library_path(cpu_decode.build_key(tier))
    assert library.exists(), "the loaded library is not the one the build key names"
    needed = subprocess.run(["readelf", "-d", str(library)], capture_output=True, text=True, check=True).stdout
    assert "libgomp.so.1" in needed
    assert cpu_decode.kernels_for(tier) is not None  # loads nothing new: the same key
    assert cpu_decode._library_path(cpu_decode.build_key(tier)) == library



@pytest.mark.parametrize("amx, int8_from, want", [(False, 9, 64), (True, 9, 8), (False, 0, 8)])
def test_the_codes_take_decode_iterations_past_the_copies_only_without_amx(monkeypatch, amx, int8_from, want):
    """Without AMX the code kernel's int8 products beat oneDNN's bfloat16 copies up to 64 rows (decode iterations);
    with AMX, or without an int8 kernel, the copies take every iteration past CODE_MAX_ROWS."""
    from dataclasses import replace

    tier = cpu_decode.cpu_tier()
    monkeypatch.setattr(cpu_decode, "cpu_tier", lambda: replace(tier, amx=amx))
    monkeypatch.setattr(cpu_decode, "int8_min_rows", lambda: int8_from)
    assert cpu_decode.code_max_rows() == want


def test_a_linear_with_a_copy_takes_the_codes_up_to_the_kernels_row_limit():
    """The Python forward follows the compiled one: past INT4_MAX_ROWS a projection with a oneDNN copy takes the code
    kernel while the model's published row limit allows (code_max_rows), the copy past it."""
    from stallfree.node_daemon.models.layers import packed_linear
    from stallfree.node_daemon.models.loader import load_model

    if not cpu_decode.ensure_built(background=False):
        pytest.skip(f"compiled decode path unavailable: {cpu_decode.why_not()}")
    model = load_model(ModelConfig(model="smollm2-135m", dtype="bfloat16")).model
    linear = model.layers[0].mlp.down_proj
    if linear.packed is None:
        pytest.skip("no oneDNN copies on this tier")
    op = cpu_decode.ops().code_matmul
    model.use_code_kernel(op, 16, int8_min_rows=9)
    x = torch.randn(17, linear.in_features, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    codes = lambda rows: op(x[:rows], linear.int4.tiles.blocks, linear.int4.tiles.bits, False, 9)  # noqa: E731
    assert torch.equal(linear(x[:16]), codes(16))
    assert torch.equal(linear(x), packed_linear(x, linear.packed, None))
    assert not torch.equal(linear(x)[:16], codes(16))  # the two paths differ: the test can tell them apart


def test_a_fused_qkv_whose_v_has_records_of_its_own_runs_the_compiled_forward(tmp_path, monkeypatch):
    """A small Q4_K_M whose second layer's v is Q6_K beside Q4_K q and k: v keeps records of its own (the tiles'
    tail, models/gguf_tiles.py split_tail), and the compiled forward's logits over a prompt follow the Python
    forward's, which multiplies the same tiles."""
    from stallfree.bench.write_random_gguf import write

    if not cpu_decode.ensure_built(background=False):
        pytest.skip(f"compiled decode path unavailable: {cpu_decode.why_not()}")
    path = tmp_path / "tiny-q4_k_m.gguf"
    write(str(path), "q4_k_m", hidden=256, layers=2)
    monkeypatch.setenv("STALLFREE_WEIGHT_CACHE", "off")
    runner = ModelRunner(ModelConfig(model=str(path), dtype="bfloat16", compiled_decode="now",
                                     release_dense_weights=True),
                         CacheConfig(block_size=16, num_blocks=16), max_num_tokens=256, max_num_seqs=4)
    assert runner.cpu_decode is not None
    assert any(w.tiles.tail is not None for w in runner.model.int4_weights())
    req = make_request("tail", [(7 * j) % 200 + 5 for j in range(40)], [1, 2, 3])
    with _python_path(runner):
        want = prefill_all_rows(runner, req, 16)
    got = prefill_all_rows(runner, req, 16)  # rewrites the same slots
    assert relative_error(got, want) < _path_tolerance()
