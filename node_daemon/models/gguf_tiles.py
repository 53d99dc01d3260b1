"""GGUF K-quant tensors (Q2_K .. Q6_K: the weights of every published Q2_K, Q3_K_M, Q4_K_M and Q5_K_M) tiled for
the code kernel by the compiled library at load (cpu_gguf_tiles.h), where it is already built for this tier; Q4_K
and Q5_K matrices into super-block records that keep the file's integers (kquant_tiles.py).

A first start on a new file otherwise decodes every weight through numpy (kquant_codes.py), lays the codes out
again (TiledCodes.from_codes) and joins the parts of q/k/v and gate/up: 8 s for a 1B Q4_K_M, most of that start.
Here the loader keeps each projection's parts as the file's bytes (GgufBlocks) until all have come, and the library
writes the joined matrix's tiles in one pass on the process's threads. The tiles are the bytes the Python path makes
(tests/test_gguf_tiles.py): the weight cache and every kernel see the same model either way. Without the library (a
fresh install's first start, which compiles it in the background) or for other types the Python path decodes.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
import torch

from stallfree.node_daemon.models import kquant_codes, kquant_tiles
from stallfree.node_daemon.models.quantized import (BlockCodes, Int4Weight, TiledCodes, decode_blocks,
                                                    grouped_record_bytes, stack_parts, tiles_from_blocks)

TILED_TYPES = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
EIGHT_BIT_TYPES = {"Q2_K", "Q3_K", "Q6_K"}  # codes past 31
SYMMETRIC_TYPES = {"Q3_K", "Q6_K"}  # zeros that follow from the scales, where float16 allows


@dataclass
class GgufBlocks:
    """One GGUF tensor's block bytes, not decoded: row i of the weight is the file's row order[i] (all rows in order
    where None)."""

    raw: np.ndarray  # [rows, bytes per row] uint8, the file's mapping
    qtype: str
    cols: int
    order: np.ndarray | None = None

    @property
    def rows(self) -> int:
        return self.raw.shape[0]

    @property
    def planes(self) -> int:
        return kquant_codes.PLANES[self.qtype]

    def take_rows(self, order: np.ndarray) -> "GgufBlocks":
        return GgufBlocks(self.raw, self.qtype, self.cols, order if self.order is None else self.order[order])

    def decode(self) -> BlockCodes:
        """The Python path's codes of the same weight."""
        block = decode_blocks(self.raw, self.qtype, self.rows, self.cols)
        return block if self.order is None else block.take_rows(self.order)

    def dequantize_torch(self) -> torch.Tensor:
        return self.decode().dequantize_torch()


def compiled_tiler():
    """The compiled library's gguf_tiles where the library is built for this tier (loaded here if need be; never
    compiled), else None."""
    from stallfree.node_daemon.models import cpu_decode

    if cpu_decode.enabled() and cpu_decode.load_if_built():
        return cpu_decode.ops().gguf_tiles
    return None


def file_blocks(raw: np.ndarray, qtype: str, rows: int, cols: int) -> GgufBlocks | None:
    """A tensor's bytes as GgufBlocks where they can be tiled from the file's bytes (a K-quant in whole tiles of 16
    rows: by the compiled library where it is built, the file's own integers by numpy too), else None (the Python
    path decodes it). Kept undecoded either way until its matrix's parts have all come: int4_of_parts decodes what
    it cannot tile, so that with the library and without a matrix splits the same way (split_tail)."""
    if qtype not in TILED_TYPES or rows % 16 or cols % kquant_codes.QK_K:
        return None
    return GgufBlocks(np.asarray(raw).reshape(rows, -1), qtype, cols)


def tiles_of_parts(parts: list[tuple[slice, GgufBlocks]], rows: int) -> TiledCodes | None:
    """One matrix's tiles from its row parts (q, k, v or gate, up; one part for the rest) by the compiled library:
    super-block records where every part is Q4_K or Q5_K (4-bit codes where all are Q4_K, else 5: kquant_tiles.py,
    which makes the same bytes without the library), 6-bit ones where every part is Q6_K and the tier runs them;
    else 8-bit codes (some part Q2_K, Q3_K or Q6_K) with zeros
    unless every part is Q3_K or Q6_K (and then too where a block's float16 scale cannot give its zero), as
    TiledCodes.from_codes lays the decoded codes out. A last part of another type than the others whose codes
    those would widen keeps records of its own (split_tail). None unless the parts cover the rows in whole tiles
    and, but for the file's own integers, the library is built."""
    split = split_tail(parts, rows)
    if split is not None:
        return split
    tiler = compiled_tiler()
    types = {part.qtype for _, part in parts}
    own_bits = kquant_tiles.own_bits(types)
    if own_bits is not None and tiler is None:
        return kquant_tiles.super_tiles(parts, rows)
    ordered = kquant_tiles.in_whole_tiles(parts, rows)
    if tiler is None or ordered is None:
        return None
    bits = record_bits(types)
    groups = ordered[0][1].cols // 32
    for zeros in ([False] if own_bits else [False, True] if types <= SYMMETRIC_TYPES else [True]):
        record = grouped_record_bytes(bits) if own_bits else bits * 64 + (64 if zeros else 32)
        out = torch.empty(rows // 16, groups, record, dtype=torch.uint8)
        written = True
        for rows_slice, part in ordered:
            with warnings.catch_warnings():  # the file's read-only mapping: only read
                warnings.simplefilter("ignore", UserWarning)
                raw = torch.from_numpy(np.ascontiguousarray(part.raw))
            order = torch.from_numpy(np.ascontiguousarray(part.order, dtype=np.int64)) if part.order is not None \
                else torch.empty(0, dtype=torch.int64)
            written = tiler(out, rows_slice.start or 0, raw, part.qtype, order) and written
        if written:
            return TiledCodes(out, bits)
    return None


def record_bits(types: set[str]) -> int:
    """The code bits of one record kind for parts of these types (tiles_of_parts)."""
    return kquant_tiles.own_bits(types) or (8 if types & EIGHT_BIT_TYPES else 5)


def split_tail(parts: list[tuple[slice, GgufBlocks]], rows: int, tiles_of=None) -> TiledCodes | None:
    """A fused matrix whose last part (in row order) is of a type the others are not, where one record kind for all
    would take wider codes than the others' own (a Q4_K_M's Q6_K v after Q4_K q and k: 8-bit codes with zeros, 9
    bits a weight, for all three; a Q3_K_M's Q4_K or Q5_K v after Q3_K q and k): the other parts' tiles with the
    last part's as their tail (TiledCodes.tail), each in its own kind; by the library, or decoded where it is not
    built, as the unsplit path does (`tiles_of`: another maker of each piece's tiles). None where no such split
    applies."""
    ordered = kquant_tiles.in_whole_tiles(parts, rows)
    if ordered is None or len(ordered) < 2:
        return None
    (_, last), head = ordered[-1], ordered[:-1]
    head_types = {part.qtype for _, part in head}
    if last.qtype in head_types or record_bits(head_types) >= record_bits(head_types | {last.qtype}):
        return None
    head_rows = rows - last.rows
    tiles_of = tiles_of or _tiles_or_decoded
    first = tiles_of(head, head_rows)
    tail = tiles_of([(slice(0, last.rows), last)], last.rows)
    if first is None or tail is None:
        return None
    return TiledCodes(first.blocks, first.bits, tail)


def _tiles_or_decoded(parts: list[tuple[slice, GgufBlocks]], rows: int) -> TiledCodes | None:
    tiles = tiles_of_parts(parts, rows)
    if tiles is not None:
        return tiles
    whole = stack_parts([(r, part.decode()) for r, part in parts], rows)
    return TiledCodes.from_codes(whole) if whole is not None else None


def tile_planes(tiles: TiledCodes) -> int:
    """The code planes torch's int4 pack takes for these tiles (TiledCodes.to_block_codes): one for 4-bit codes
    alone, else two."""
    return 1 if tiles.bits == 4 and (tiles.tail is None or tiles.tail.bits == 4) else 2


def int4_of_parts(parts: list[tuple[slice, BlockCodes | GgufBlocks]], rows: int, dtype: torch.dtype) \
        -> Int4Weight | None:
    """The Int4Weight of a projection whose parts have all come (models/llama.py add_codes): tiled by the compiled
    library where every part is still the file's bytes, else decoded and joined on the Python path. None unless the
    parts cover its rows (in a multiple of 16)."""
    if parts and all(isinstance(part, GgufBlocks) for _, part in parts):
        tiles = tiles_of_parts(parts, rows)  # type: ignore[arg-type]
        if tiles is not None:
            return Int4Weight.from_tiles(tiles, tile_planes(tiles), dtype)
    decoded = [(r, part.decode() if isinstance(part, GgufBlocks) else part) for r, part in parts]
    whole = stack_parts(decoded, rows)
    return Int4Weight(whole, dtype) if whole is not None and whole.rows % 16 == 0 else None


def tiles_from_file(raw: np.ndarray, qtype: str, rows: int, cols: int) -> tuple[TiledCodes, int] | None:
    """A large matrix's tiles (a tied embedding that is also the head): by the compiled library where it can,
    else quantized.tiles_from_blocks a slice at a time. (tiles, planes), or None for a type without codes."""
    blocks = file_blocks(raw, qtype, rows, cols)
    tiles = tiles_of_parts([(slice(0, rows), blocks)], rows) if blocks is not None else None
    if tiles is not None:
        return tiles, tile_planes(tiles)
    return tiles_from_blocks(raw, qtype, rows, cols)
