"""GGUF K-quant blocks tiled by the compiled library at load (models/cpu_gguf_tiles.h, models/gguf_tiles.py): the
same bytes as the Python path's decode (kquant_codes.py) and layout (TiledCodes.from_codes; Q4_K and Q5_K
matrices, and Q6_K or Q3_K ones where the tier runs 6- and 3-bit records: records holding the file's integers, kquant_tiles.py,
gguf's values exactly), for Q2_K .. Q6_K alone, for the fused projections of Q4_K_M, Q3_K_M and Q2_K files (Q4_K q/k beside a Q6_K or Q4_K v, Q3_K q/k beside
a Q5_K or Q6_K v, in any order of arrival, q's rows unpermuted), for Q6_K blocks whose float16 scales cannot give their zeros (the layout then stores zeros, as the
Python path does), and for a whole model loaded both ways; bad shapes and types are refused with a clear error.

Random valid blocks (every scale, min and code bit pattern) as tests/test_kquants.py makes them. Without a C++
compiler the library is not built and these skip."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from stallfree.bench import gguf_blocks
from stallfree.node_daemon.models import cpu_decode, kquant_tiles
from stallfree.node_daemon.models.gguf_tiles import GgufBlocks, int4_of_parts, split_tail, tiles_of_parts
from stallfree.node_daemon.models.quantized import TiledCodes, decode_blocks, grouped_record_bytes, stack_parts
from model_helpers import relative_error
from test_kquants import _random_k_blocks


@pytest.fixture(scope="module", autouse=True)
def library():
    if not cpu_decode.enabled() or not cpu_decode.ensure_built(background=False):
        pytest.skip(f"compiled extension unavailable: {cpu_decode.why_not()}")


def _python_tiles(parts: list[tuple[slice, GgufBlocks]], rows: int) -> TiledCodes:
    """The numpy path's tiles: records of the file's integers where every part is Q4_K or Q5_K, or every part
    Q6_K (or every part Q3_K) on a tier that runs them (kquant_tiles.py), else the decoded codes laid out by
    TiledCodes.from_codes; a last part of another type in its own records (split_tail), each piece so made."""
    head_and_tail = split_tail(parts, rows, tiles_of=_python_tiles)
    if head_and_tail is not None:
        return head_and_tail
    if kquant_tiles.own_bits({p.qtype for _, p in parts}) is not None:
        tiles = kquant_tiles.super_tiles(parts, rows)
        assert tiles is not None and (tiles.is_super or tiles.is_halves)
        return tiles
    whole = stack_parts([(r, p.decode()) for r, p in parts], rows)
    assert whole is not None
    return TiledCodes.from_codes(whole)


def _assert_same_tiles(got: TiledCodes | None, want: TiledCodes) -> None:
    assert got is not None
    assert (got.bits, got.has_zeros, got.is_super, got.is_halves, tuple(got.blocks.shape)) == \
        (want.bits, want.has_zeros, want.is_super, want.is_halves, tuple(want.blocks.shape))
    assert torch.equal(got.blocks, want.blocks)
    assert (got.tail is None) == (want.tail is None)
    if got.tail is not None:
        _assert_same_tiles(got.tail, want.tail)


@pytest.mark.parametrize("qtype, bits", [("Q2_K", 8), ("Q3_K", 3), ("Q4_K", 4), ("Q5_K", 5), ("Q6_K", 6)])
def test_one_k_quant_tensor_is_tiled_into_the_python_paths_bytes(qtype, bits):
    rows, cols = 48, 512
    raw = _random_k_blocks(qtype, rows, cols, seed=11) if qtype not in ("Q2_K", "Q3_K") else \
        gguf_blocks.random_blocks(qtype, rows, cols, np.random.default_rng(11))
    part = GgufBlocks(raw, qtype, cols)
    got = tiles_of_parts([(slice(0, rows), part)], rows)
    _assert_same_tiles(got, _python_tiles([(slice(0, rows), part)], rows))
    assert got.bits == (8 if qtype in ("Q6_K", "Q3_K") and not kquant_tiles.halves_records() else bits)


def _q6_k_beside_q3_k(d: float, seed: int) -> tuple[list[tuple[slice, GgufBlocks]], int]:
    """Q6_K parts of float16 d around a Q3_K one (both symmetric: 8-bit records, zeros only where needed; the last
    part's type is the first's, so no records of its own: split_tail)."""
    rows, cols = 32, 256
    raw = _random_k_blocks("Q6_K", rows, cols, seed=seed).reshape(-1, 210)
    raw[:, 208:210] = np.full((raw.shape[0], 1), d, "<f2").view(np.uint8)
    q6 = raw.reshape(rows, -1)
    q3 = GgufBlocks(gguf_blocks.random_blocks("Q3_K", 16, cols, np.random.default_rng(seed)), "Q3_K", cols)
    return [(slice(0, 16), GgufBlocks(q6[:16], "Q6_K", cols)), (slice(16, 32), q3),
            (slice(32, 48), GgufBlocks(q6[16:], "Q6_K", cols))], rows + 16


def test_q6_k_blocks_whose_float16_scales_cannot_give_their_zeros_store_zeros():
    """d of 2e-6: a block's scale d*step is subnormal in float16, so -128 times it rounded is not its zero
    rounded; the Python path then lays the matrix out with zeros, and so must the library (8-bit records: Q6_K
    beside another type)."""
    parts, rows = _q6_k_beside_q3_k(2e-6, seed=12)
    want = _python_tiles(parts, rows)
    assert want.has_zeros and want.bits == 8  # the case under test
    _assert_same_tiles(tiles_of_parts(parts, rows), want)


def test_q6_k_blocks_of_a_normal_size_need_no_zeros():
    parts, rows = _q6_k_beside_q3_k(0.02, seed=13)
    want = _python_tiles(parts, rows)
    assert not want.has_zeros and want.bits == 8
    _assert_same_tiles(tiles_of_parts(parts, rows), want)


@pytest.mark.parametrize("qk_type, v_type", [("Q4_K", "Q4_K"), ("Q4_K", "Q5_K"), ("Q4_K", "Q6_K"), ("Q3_K", "Q5_K"),
                                             ("Q3_K", "Q6_K"), ("Q2_K", "Q3_K")])
def test_fused_q_k_v_parts_of_mixed_types_join_as_the_python_path_joins_them(qk_type, v_type):
    """Q4_K_M's q/k/v mixes, Q3_K_M's (Q3_K q/k beside a Q5_K or Q6_K v) and Q2_K's (Q2_K q/k, Q3_K v)."""
    cols, q_rows, kv_rows = 512, 64, 32
    order = np.random.default_rng(0).permutation(q_rows)  # q's rows unpermuted for RoPE, as the loader does

    def blocks(qtype: str, rows: int, seed: int) -> np.ndarray:
        if qtype in ("Q2_K", "Q3_K"):
            return gguf_blocks.random_blocks(qtype, rows, cols, np.random.default_rng(seed))
        return _random_k_blocks(qtype, rows, cols, seed=seed)

    q = GgufBlocks(blocks(qk_type, q_rows, 14), qk_type, cols).take_rows(order)
    k = GgufBlocks(blocks(qk_type, kv_rows, 15), qk_type, cols)
    v = GgufBlocks(blocks(v_type, kv_rows, 16), v_type, cols)
    rows = q_rows + 2 * kv_rows
    parts = [(slice(q_rows + kv_rows, rows), v), (slice(0, q_rows), q), (slice(q_rows, q_rows + kv_rows), k)]
    _assert_same_tiles(tiles_of_parts(parts, rows), _python_tiles(parts, rows))
    weight = int4_of_parts(parts, rows, torch.bfloat16)
    assert weight is not None and weight.planes == stack_parts([(r, p.decode()) for r, p in parts], rows).planes


@pytest.mark.parametrize("qk_type, v_type", [("Q4_K", "Q6_K"), ("Q3_K", "Q4_K"), ("Q3_K", "Q5_K")])
def test_a_v_of_another_type_keeps_records_of_its_own(qk_type, v_type):
    """A Q4_K_M's Q6_K v after Q4_K q and k (a Q3_K_M's Q4_K or Q5_K v after Q3_K q and k): q and k keep their own
    records and v its own (TiledCodes.tail), fewer bytes than one record kind of 8-bit codes for all three; the
    weights are the parts' own tiles' joined, and the code kernel's matmul of the whole is x @ W^T of them."""
    from stallfree.node_daemon.models import cpu_decode

    if qk_type == "Q3_K" and not kquant_tiles.halves_records():
        pytest.skip("this tier keeps Q3_K's 8-bit codes: q and k would take v's codes' width anyway")
    cols, q_rows, kv_rows = 512, 64, 32

    def blocks(qtype: str, rows: int, seed: int) -> GgufBlocks:
        raw = gguf_blocks.random_blocks(qtype, rows, cols, np.random.default_rng(seed)) if qtype == "Q3_K" \
            else _random_k_blocks(qtype, rows, cols, seed=seed)
        return GgufBlocks(raw, qtype, cols)

    q, k, v = blocks(qk_type, q_rows, 1), blocks(qk_type, kv_rows, 2), blocks(v_type, kv_rows, 3)
    rows = q_rows + 2 * kv_rows
    parts = [(slice(0, q_rows), q), (slice(q_rows, q_rows + kv_rows), k), (slice(q_rows + kv_rows, rows), v)]
    tiles = tiles_of_parts(parts, rows)
    assert tiles is not None and tiles.tail is not None and tiles.out_features == rows
    head = tiles_of_parts(parts[:2], q_rows + kv_rows)
    alone = tiles_of_parts([(slice(0, kv_rows), v)], kv_rows)
    assert torch.equal(tiles.blocks, head.blocks) and tiles.bits == head.bits
    assert torch.equal(tiles.tail.blocks, alone.blocks) and tiles.tail.bits == alone.bits
    one_kind = TiledCodes.from_codes(stack_parts([(r, p.decode()) for r, p in parts], rows))
    assert one_kind.bits == 8 and tiles.nbytes < one_kind.nbytes
    want = torch.cat([head.dequantize(), alone.dequantize()])
    torch.testing.assert_close(tiles.dequantize(), want, rtol=0, atol=0)
    weight = int4_of_parts(parts, rows, torch.bfloat16)
    assert weight is not None and weight.out_features == rows
    weight.code_kernel = (cpu_decode.ops().code_matmul, 64, 9)
    x = torch.randn(12, cols, generator=torch.Generator().manual_seed(4)).bfloat16()
    for count in (1, 3, 12):  # int16 activations, then int8 from 9 rows
        got = weight.matmul(x[:count], float_out=True).double()
        # float32 sums: int16 activations' rounding (3e-4: test_code_matmul.py), int8's from 9 rows (0.03)
        assert relative_error(got, x[:count].double() @ want.double().T) < (0.03 if count >= 9 else 3e-4)
    # the Python path's int4 pack joins the two as stack_parts joins parts
    assert weight.tiles.to_block_codes().rows == rows and weight.planes == 2


def test_parts_that_leave_rows_uncovered_or_split_a_tile_fall_back_to_the_python_path():
    cols = 256
    a = GgufBlocks(_random_k_blocks("Q4_K", 16, cols, seed=17), "Q4_K", cols)
    assert tiles_of_parts([(slice(0, 16), a)], 32) is None  # rows 16..31 missing
    assert tiles_of_parts([(slice(16, 32), a)], 32) is None  # rows 0..15 missing
    odd = GgufBlocks(_random_k_blocks("Q4_K", 8, cols, seed=18)[:8], "Q4_K", cols)
    assert tiles_of_parts([(slice(0, 8), odd), (slice(8, 24), a)], 24) is None
    # the same parts decoded and joined on the Python path: torch's int4 kernel needs whole tiles, so none
    assert int4_of_parts([(slice(0, 8), odd), (slice(8, 24), a)], 24, torch.bfloat16) is None


def test_the_library_refuses_bad_shapes_and_types_with_a_clear_error():
    tiler = cpu_decode.ops().gguf_tiles
    raw = torch.from_numpy(_random_k_blocks("Q4_K", 16, 256, seed=19))
    out = torch.empty(1, 8, 4 * 64 + 64, dtype=torch.uint8)
    none = torch.empty(0, dtype=torch.int64)
    assert tiler(out, 0, raw, "Q4_K", none)
    with pytest.raises(RuntimeError, match="Q2_K, Q3_K, Q4_K, Q5_K or Q6_K"):
        tiler(out, 0, raw, "Q8_0", none)
    with pytest.raises(RuntimeError, match="raw"):
        tiler(out, 0, raw[:, :100].contiguous(), "Q4_K", none)
    with pytest.raises(RuntimeError, match="whole tiles"):
        tiler(out, 16, raw, "Q4_K", none)
    with pytest.raises(RuntimeError, match="order names row 16"):
        tiler(out, 0, raw, "Q4_K", torch.arange(1, 17))
    with pytest.raises(RuntimeError, match="do not fit"):  # Q6_K's 8-bit codes in 4-bit records
        tiler(out, 0, torch.from_numpy(_random_k_blocks("Q6_K", 16, 256, seed=20)), "Q6_K", none)
    with pytest.raises(RuntimeError, match="out"):
        tiler(torch.empty(1, 8, 100, dtype=torch.uint8), 0, raw, "Q4_K", none)
    with pytest.raises(RuntimeError, match="do not fit"):  # Q3_K's 8-bit codes in 5-bit super-block records
        tiler(torch.empty(1, 8, grouped_record_bytes(5), dtype=torch.uint8), 0,
              torch.from_numpy(gguf_blocks.random_blocks("Q3_K", 16, 256, np.random.default_rng(21))), "Q3_K", none)


@pytest.mark.parametrize("qtype, bits_a_weight",
                         [("Q4_K", 4.625), ("Q5_K", 5.625), ("Q6_K", 6.625), ("Q3_K", 4.5625)])
def test_k_quant_matrices_keep_the_files_integers(qtype, bits_a_weight):
    """Super-block records hold the file's sub-block scales and mins and its float16 d and dmin, 6-bit records
    Q6_K's codes, int8 scales and d, 3-bit ones Q3_K's: their weights are gguf's dequantized values exactly (no
    float16 rounding of d * sc, no re-coding), a sixteenth to an eighth of a bit a weight over the file (Q3_K's
    3-bit codes in 4-bit nibbles: 1.125 bits over its 3.4375, where its 8-bit codes took 8.5)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    halves = qtype in ("Q6_K", "Q3_K")
    if halves and not kquant_tiles.halves_records():
        pytest.skip(f"this tier keeps {qtype}'s 8-bit codes (kquant_tiles.halves_records)")
    rows, cols = 32, 768
    raw = _random_k_blocks(qtype, rows, cols, seed=22) if qtype != "Q3_K" else \
        gguf_blocks.random_blocks(qtype, rows, cols, np.random.default_rng(22))
    tiles = tiles_of_parts([(slice(0, rows), GgufBlocks(raw, qtype, cols))], rows)
    assert tiles is not None and (tiles.is_halves if halves else tiles.is_super) and not tiles.has_zeros
    want = dequantize(raw, GGMLQuantizationType[qtype]).reshape(rows, cols)
    np.testing.assert_array_equal(tiles.dequantize().numpy(), want)
    assert tiles.nbytes * 8 / (rows * cols) == bits_a_weight
    ids = torch.tensor([0, 7, 31])
    np.testing.assert_array_equal(tiles.rows(ids).numpy(), want[ids.numpy()])


def test_a_k_quant_model_loads_to_the_same_tiles_with_the_library_and_without(tmp_path, monkeypatch):
    """A small Llama-shaped Q4_K_M (Q4_K q/k/o/gate/up, Q6_K v and down in its second layer, a Q6_K tied
    embedding): every coded weight's tiles are the same bytes whether the library tiled them or Python decoded
    them (super-block records by numpy: kquant_tiles.py)."""
    from stallfree.bench.write_random_gguf import write
    from stallfree.node_daemon.models import gguf_tiles, weight_cache
    from stallfree.node_daemon.models.gguf_loader import load_gguf

    path = tmp_path / "tiny-q4_k_m.gguf"
    write(str(path), "q4_k_m", hidden=256, layers=2)
    monkeypatch.setenv("STALLFREE_WEIGHT_CACHE", "off")

    def weights():
        model = load_gguf(str(path), torch.bfloat16, torch.device("cpu"), release_dense=True).model
        return {n: w.tiles for n, w in weight_cache._int4_weights(model).items()}

    tiled = weights()
    monkeypatch.setattr(gguf_tiles, "compiled_tiler", lambda: None)  # the Python path
    decoded = weights()
    assert tiled.keys() == decoded.keys() and len(tiled) >= 8
    for name in tiled:
        _assert_same_tiles(tiled[name], decoded[name])
    assert sum(t.is_super for t in tiled.values()) >= 4  # gate/up and o of both layers, q/k/v of the first
    if kquant_tiles.halves_records():
        assert sum(t.is_halves for t in tiled.values()) >= 2  # the second layer's down and the tied embedding
