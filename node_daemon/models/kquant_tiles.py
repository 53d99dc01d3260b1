"""Q4_K and Q5_K matrices as the code kernel's super-block records (models/cpu_code_matmul.h's kSuper): each block
keeps its 16 columns' 6-bit sub-block scales sc and mins m as bytes, and each super-block of 8 blocks its 16
columns' float16 d and dmin; a super-block's 8 records are stored grouped, their codes first (each on whole 64-byte
lines), then their integers, then the header. A weight is then (d * sc) * q - dmin * m exactly as the file
holds it, in 4.625 bits (Q4_K; 5.625 for Q5_K) where float16 scales and zeros per 32 weights took 5 (6) and were
rounded (the file: 4.5 and 5.5 bits).

Q6_K matrices take 6-bit records of the same grouping (cpu_code_matmul.h's kHalves) where the tier's kernel runs
them (halves_records): the file's codes u = q + 32, its int8 scale of each 16 weights, each super-block's float16 d;
a weight is (d * sc) * q exactly as gguf computes it, in 6.625 bits (the file: 6.5625) where the 8-bit re-coding
took 8.5. Q3_K matrices take the same form with 3-bit codes u = q + 4 in 4-bit nibbles and a header of d alone:
4.5625 bits (the file: 3.4375) where the 8-bit codes took 8.5. The AVX2 kernel, whose one-row rate its int16
products already bound, does not run them (they would add instructions at every product: no ternary logic, half
the lanes); that tier keeps the 8-bit codes.

These are made in numpy here (the reference, and the path while the compiled library is not built) and by the
compiled tiler (models/cpu_gguf_tiles.h) from the same bytes; tests/test_gguf_tiles.py holds the two equal.
"""
from __future__ import annotations

import warnings

import numpy as np
import torch

from stallfree.node_daemon.models import kquant_codes
from stallfree.node_daemon.models.quantized import TiledCodes, grouped_record_bytes, tile_code_bytes

SUPER_TYPES = ("Q4_K", "Q5_K")
HALVES_BITS = {"Q6_K": 6, "Q3_K": 3}  # kHalves records' code bits, and their offset 2^(bits-1)


def halves_records() -> bool:
    """Whether Q6_K and Q3_K matrices take their own records here: the AVX512-VNNI kernel runs them."""
    from stallfree.node_daemon.models.cpu_tier import cpu_tier

    return cpu_tier().vnni


def own_bits(qtypes: set[str]) -> int | None:
    """The code bits of a matrix whose parts have these types, where they keep the file's integers (4: every part
    Q4_K; 5: Q5_K among them, super-block records; 6: every part Q6_K, 3: every part Q3_K, on a tier that runs
    kHalves records); None for any other type."""
    if len(qtypes) == 1 and next(iter(qtypes)) in HALVES_BITS:
        return HALVES_BITS[next(iter(qtypes))] if halves_records() else None
    if not qtypes or not qtypes <= set(SUPER_TYPES):
        return None
    return 4 if qtypes == {"Q4_K"} else 5


def file_integers(raw: np.ndarray, qtype: str, rows: int, cols: int) \
        -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """A Q4_K/Q5_K tensor's block bytes [rows, cols / 256 * bytes] -> (codes [rows, cols] uint8 in 0..15 or 0..31,
    sc and m [rows, cols / 32] uint8, d and dmin [rows, cols / 256] float16 bits as uint16), as gguf reads them."""
    from gguf.quants import Q4_K

    supers = cols // kquant_codes.QK_K
    blocks = np.ascontiguousarray(raw).reshape(rows * supers, kquant_codes.BLOCK_BYTES[qtype])
    d = blocks[:, 0:2].copy().view(np.uint16).reshape(rows, supers)
    dmin = blocks[:, 2:4].copy().view(np.uint16).reshape(rows, supers)
    sc, m = Q4_K.get_scale_min(np.ascontiguousarray(blocks[:, 4:16]))
    codes = kquant_codes.low_nibbles_then_high(blocks[:, -128:])
    if qtype == "Q5_K":
        codes = codes | (kquant_codes.q5_k_fifth_bits(blocks) << 4)
    return (codes.reshape(rows, cols), sc.astype(np.uint8).reshape(rows, -1), m.astype(np.uint8).reshape(rows, -1),
            d, dmin)


def in_whole_tiles(parts: list, rows: int) -> list | None:
    """A matrix's (row slice, part) pairs in row order where they cover its rows in whole tiles of 16, else None."""
    ordered = sorted(parts, key=lambda item: item[0].start or 0)
    covered = 0
    for rows_slice, part in ordered:
        if (rows_slice.start or 0) != covered or part.rows % 16:
            return None
        covered += part.rows
    return ordered if ordered and covered == rows and rows % 16 == 0 else None


def super_tiles(parts: list, rows: int) -> TiledCodes | None:
    """One matrix's records of the file's integers from its row parts (models/gguf_tiles.py GgufBlocks: q, k, v or
    gate, up; one part for the rest, each part's rows in its `order`): super-block records where every part is Q4_K
    or Q5_K, kHalves ones where every part is Q6_K or every part Q3_K (own_bits). None for other types or unless
    the parts cover the rows in whole tiles of 16."""
    bits = own_bits({part.qtype for _, part in parts})
    ordered = in_whole_tiles(parts, rows)
    if bits is None or ordered is None:
        return None
    cols = ordered[0][1].cols
    if bits in (3, 6):
        return halves_tiles(ordered, rows, cols)
    joined = [file_integers(part.raw, part.qtype, part.rows, cols) for _, part in ordered]
    joined = [[a if part.order is None else a[part.order] for a in arrays]
              for (_, part), arrays in zip(ordered, joined)]
    codes, sc, m, d, dmin = (np.concatenate(column) for column in zip(*joined))
    tiles, groups, supers = rows // 16, cols // 32, cols // kquant_codes.QK_K

    def per_tile(values: np.ndarray) -> torch.Tensor:  # [rows, n] -> [tile, n, 16 columns]
        return torch.from_numpy(values).reshape(tiles, 16, -1).transpose(1, 2)

    # per tile and super-block: its 8 blocks' codes, their 8 x (16 sc, 16 m), its header (16 float16 d, 16 dmin)
    header = torch.cat([per_tile(d), per_tile(dmin)], dim=-1).contiguous().view(torch.uint8)  # [tile, super, 64]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        code_bytes = tile_code_bytes(torch.from_numpy(codes), bits)  # [tile, block, bits * 64]
    ints = torch.cat([per_tile(sc), per_tile(m)], dim=-1)  # [tile, block, 32]
    grouped = torch.cat([code_bytes.reshape(tiles, supers, -1), ints.reshape(tiles, supers, -1), header], dim=-1)
    return TiledCodes(grouped.reshape(tiles, groups, grouped_record_bytes(bits)).contiguous(), bits)


def halves_tiles(ordered: list, rows: int, cols: int) -> TiledCodes:
    """Q6_K or Q3_K parts (one type, in row order, covering the rows in whole tiles: in_whole_tiles) as kHalves
    records, grouped as super_tiles' (per super-block: 8 blocks' codes u = q + 2^(bits-1), their 8 x (16 first-half
    and 16 last-half int8 scales), a header of 16 float16 d, and for 6 bits 32 zero bytes after them)."""
    qtype = ordered[0][1].qtype
    bits = HALVES_BITS[qtype]
    integers = kquant_codes.q6_k_integers if qtype == "Q6_K" else kquant_codes.q3_k_integers
    joined = []
    for _, part in ordered:
        blocks = np.ascontiguousarray(part.raw).reshape(-1, kquant_codes.BLOCK_BYTES[qtype])
        q, sc, d = integers(blocks)
        arrays = [(q + (1 << (bits - 1))).astype(np.uint8).reshape(part.rows, cols),
                  sc.astype(np.int8).reshape(part.rows, -1),
                  d.astype(np.float16).view(np.uint16).reshape(part.rows, -1)]
        joined.append([a if part.order is None else a[part.order] for a in arrays])
    codes, sc, d = (np.concatenate(column) for column in zip(*joined))
    tiles, groups, supers = rows // 16, cols // 32, cols // kquant_codes.QK_K
    # [row, block, half] -> [tile, block, half, 16 columns]
    scales = torch.from_numpy(sc.view(np.uint8)).reshape(tiles, 16, groups, 2).permute(0, 2, 3, 1) \
        .reshape(tiles, groups, 32)
    header = torch.from_numpy(d).reshape(tiles, 16, supers).transpose(1, 2).contiguous().view(torch.uint8)
    if bits == 6:
        header = torch.cat([header, torch.zeros(tiles, supers, 32, dtype=torch.uint8)], dim=-1)  # [tile, super, 64]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        code_bytes = tile_code_bytes(torch.from_numpy(codes), bits)  # [tile, block, 384 or 256]
    grouped = torch.cat([code_bytes.reshape(tiles, supers, -1), scales.reshape(tiles, supers, -1), header], dim=-1)
    return TiledCodes(grouped.reshape(tiles, groups, grouped_record_bytes(bits)).contiguous(), bits)
