"""models/weight_cache.py: a GGUF model loaded from the cache is the decoded one (every parameter and int4 pack,
hence every logit); the key follows the file and dtype; an unreadable cache file falls back to decoding."""
from __future__ import annotations

import torch

from stallfree.node_daemon.models import weight_cache
from stallfree.node_daemon.models.config import ModelConfig
from stallfree.node_daemon.models.gguf_loader import embedded_gguf_path
from stallfree.node_daemon.models.loader import load_model


def _load():
    model = load_model(ModelConfig(model="smollm2-135m", dtype="bfloat16")).model
    weight_cache.flush()  # a first load writes its file in the background
    return model


def _int4s(model):
    return {n: m.int4 for n, m in model.named_modules() if getattr(m, "int4", None) is not None} | \
        {"tied": model.tied_lm_head_int4}


def test_a_model_from_the_cache_is_the_decoded_model(tmp_path, monkeypatch):
    monkeypatch.setenv(weight_cache.ENV, str(tmp_path))
    decoded = _load()  # writes the cache
    assert len(list(tmp_path.glob("*.safetensors"))) == 1
    cached = _load()
    for (name, a), (_, b) in zip(decoded.named_parameters(), cached.named_parameters()):
        assert torch.equal(a, b), name
    want, got = _int4s(decoded), _int4s(cached)
    assert set(want) == set(got)
    for name in want:
        assert got[name].planes == want[name].planes and got[name].out_features == want[name].out_features
        assert torch.equal(got[name].packed, want[name].packed) and \
            torch.equal(got[name].scales_and_zeros, want[name].scales_and_zeros), name
        # the code kernel's tiles
        assert got[name].tiles.bits == want[name].tiles.bits and torch.equal(got[name].tiles.blocks,
                                                                              want[name].tiles.blocks), name
    x = torch.randn(3, decoded.shape.hidden_size, generator=torch.Generator().manual_seed(1)).bfloat16()
    assert torch.equal(decoded.compute_logits(x), cached.compute_logits(x))


def test_the_key_follows_dtype_and_the_switch(tmp_path, monkeypatch):
    path = embedded_gguf_path()
    monkeypatch.setenv(weight_cache.ENV, str(tmp_path))
    assert weight_cache.cache_file(path, torch.bfloat16) != weight_cache.cache_file(path, torch.float16)
    assert weight_cache.cache_file(path, torch.bfloat16).parent == tmp_path
    monkeypatch.setenv(weight_cache.ENV, "off")
    assert weight_cache.cache_file(path, torch.bfloat16) is None


def test_the_key_follows_the_cpu_tier_and_torchs_vector_width(tmp_path, monkeypatch):
    """torch's int4 packs are laid out for the vector width its kernels run at: a pack cached by an AVX-512 run and
    read back at a forced AVX2 tier gave garbage logits (SmolLM2's greedy tokens all wrong), so each is its own file."""
    from stallfree.node_daemon.models import cpu_tier

    path = embedded_gguf_path()
    monkeypatch.setenv(weight_cache.ENV, str(tmp_path))
    native = weight_cache.cache_file(path, torch.bfloat16)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2-other")
    assert weight_cache.cache_file(path, torch.bfloat16) != native
    monkeypatch.undo()
    monkeypatch.setenv(weight_cache.ENV, str(tmp_path))
    monkeypatch.setattr(cpu_tier, "cpu_tier", lambda: cpu_tier.resolve_tier("generic"))
    assert weight_cache.cache_file(path, torch.bfloat16) != native


def test_an_unreadable_cache_file_is_decoded_again_and_rewritten(tmp_path, monkeypatch):
    monkeypatch.setenv(weight_cache.ENV, str(tmp_path))
    target = weight_cache.cache_file(embedded_gguf_path(), torch.bfloat16)
    target.write_bytes(b"not a safetensors file")
    model = _load()
    assert model.tied_lm_head_int4 is not None and target.stat().st_size > 1 << 20  # rewritten whole


def test_a_write_keeps_the_most_recently_used_files_of_its_model_and_removes_the_rest(tmp_path):
    """Each upgrade, tier or dtype is a new key: without pruning the folder grew by a model's size at each (40 GB on
    a development machine). A write keeps KEEP_PER_MODEL files of its GGUF name, the newest by last use, and leaves
    other models' files alone; a name that merely starts the same is another model."""
    import os

    def cache(stem: str, digest: str, age_s: float):
        path = tmp_path / f"{stem}-{digest * 20}.safetensors"
        path.write_bytes(b"x")
        os.utime(path, (path.stat().st_atime, path.stat().st_mtime - age_s))
        return path

    old = [cache("gemma-3-270m-q4_k_m", d, age) for d, age in zip("abcde", (50, 40, 30, 20, 10))]
    other = cache("gemma-3-270m-q4_k_m-extra", "f", 100)  # another file name, however old
    elsewhere = cache("SmolLM2-135M-Instruct.Q4_1", "0", 100)
    kept = tmp_path / f"gemma-3-270m-q4_k_m-{'9' * 20}.safetensors"
    assert weight_cache._write({"t": torch.zeros(1)}, {}, kept)  # writes, then prunes
    assert {p for p in tmp_path.iterdir()} == {kept, old[3], old[4], other, elsewhere}  # the 3 least recently used gone
    assert weight_cache.prune(kept) == []


def test_loading_a_cache_file_marks_it_used(tmp_path, monkeypatch):
    import os

    monkeypatch.setenv(weight_cache.ENV, str(tmp_path))
    _load()  # writes the cache
    (path,) = tmp_path.glob("*.safetensors")
    os.utime(path, (0, 0))
    _load()
    assert path.stat().st_mtime > 0
