"""GGUF block-quantized weights kept quantized on the CPU: torch's int4 weight-only matmul, group size 32.

torch's `_weight_int4pack_mm_for_cpu(x, packed, 32, scales_and_zeros)` dequantizes every group of 32
weights along K as `(q - 8) * scale + zero`, q a 4-bit code, accumulating in float32. GGUF's 32-weight
blocks map onto it exactly, up to the rounding of scale and zero to the activation dtype:

    Q4_0  w = (q - 8) * d          -> scale d, zero 0
    Q4_1  w = q * d + m            -> scale d, zero m + 8d
    Q8_0  w = q * d, q in [-128, 127]: with u = q + 128 = 16 hi + lo (two nibbles),
          w = (lo - 8) * d + 8d  +  (hi - 8) * 16d
                                   -> two code planes along K: lo (scale d, zero 8d), hi (scale 16d, zero 0);
                                      the activations are repeated once along K ([x, x]) to meet both.

The K-quants (Q3_K, Q4_K, Q5_K exactly; Q6_K re-coded to 8-bit codes per 32 weights, within 1/8 of its own 6-bit
step, where it is not kept in its own 6-bit records; Q2_K re-coded within a 510th of each 32 weights' range) map the
same way (models/kquant_codes.py), and so do Q5_0, Q5_1, IQ4_NL and IQ4_XS, exactly (models/small_block_codes.py).
Other types (the IQ1-IQ3 types, TQ1_0, TQ2_0) have no such mapping here; their tensors are dequantized and the daemon
names them at start-up, in /metrics and in the stats the operator reads.

Every weight with codes also keeps them as TiledCodes, the layout of the compiled extension's code kernel
(models/cpu_code_matmul.h): activations quantized to int16 per 32-wide block (int8 from INT8_MIN_ROWS rows where
the tier has an int8 body) and the codes multiplied as they are stored, no float weight ever made, on every x86 tier (AVX512-VNNI, AVX2, portable loops; models/cpu_tier.py). Where
oneDNN runs bfloat16 GEMMs (the AVX-512 tiers) iterations from DEQUANT_MIN_ROWS rows are compute-bound, and there
each projection is dequantized into a scratch, one at a time, for oneDNN's GEMM (models/cpu_code_dequantize.h); kept
dense copies prepacked for it (--cpu-dense-copy on) take the iterations past CODE_MAX_ROWS instead. Below AVX-512,
and where the code kernel's int8 products outrun oneDNN's GEMM (VNNI, no AMX: CpuTier.int8_outruns_onednn),
every row count takes the code kernel and no dense copy is kept. Before the extension is loaded (a first start
compiles it in the background) torch's int4 kernel serves the same codes. STALLFREE_CPU_CODE_KERNEL=0 keeps torch's
int4 kernel (an A/B switch).
"""
from __future__ import annotations

import os
import warnings
from dataclasses import dataclass

import numpy as np
import torch

from stallfree.node_daemon.models import kquant_codes, small_block_codes

GROUP_SIZE = 32
# Rows (tokens in an iteration) up to which a linear layer takes its int4 weight (measured crossover on
# a 2-core AVX512-BF16 CPU: int4 wins up to 8 rows, bfloat16 from 16).
INT4_MAX_ROWS = 8
# Rows up to which the compiled code kernel (models/cpu_code_matmul.h) takes the quantized weights where oneDNN's
# bfloat16 GEMM takes the rest (AVX-512), measured in SmolLM2's compiled forward on a 2-core AVX512-VNNI CPU against
# torch's int4 kernel and oneDNN's GEMM: 1.11x at 1 row, 1.19x at 4, 1.33x at 8; at 16 rows it is compute-bound and
# oneDNN's GEMM is 1.15x faster. Where a weight has no oneDNN copy (below AVX-512, or a model too large for one:
# models/loader.py) the code kernel takes every row count, up to DEQUANT_MIN_ROWS on AVX-512.
CODE_MAX_ROWS = 8
# Rows from which the code kernel quantizes activations to int8 instead of int16, where the tier has an int8 kernel
# (AVX512-VNNI: VPDPBUSD, twice the products an instruction): iterations past CODE_MAX_ROWS that no oneDNN copy
# takes (a model without copies, such as any 1B) are compute-bound there, and int8 ran them 1.4-1.8x faster
# (4-, 5- and 8-bit tiles of 2048 x 640 to 8192 x 2048 at 8-64 rows, 2 threads, Sapphire Rapids). Its rounding
# (a 254th of a block's largest activation) costs 0.5-1% of a product's value where int16's costs 0.003%, so on a
# CPU with AMX the few-row iterations of a decode keep int16: memory-bound there, they would gain nothing.
# STALLFREE_CPU_INT8=0: never.
INT8_MIN_ROWS = CODE_MAX_ROWS + 1
INT8_SWITCH = "STALLFREE_CPU_INT8"
# On a CPU without AMX (AMD Zen 4) oneDNN's bfloat16 GEMM is slower than the code kernel's int8 products, and a
# decode iteration of up to 64 rows takes the code kernel (int8 from INT8_MIN_ROWS) even where a oneDNN copy is
# kept (cpu_decode.code_max_rows); the copies keep the prefill chunks past 64 rows. SmolLM2's compiled forward at
# 16, 32 and 64 rows, 2 threads, Zen 4 (`bench iteration --compiled-decode now`): 21.2, 38.9 and 63.2 ms on the
# codes against 34.3, 51.1 and 84.7 ms on the copies. int8 at 1-8 rows would be 1.05-1.26x there too (every
# projection of SmolLM2, Gemma 3 270M and a 1B Q4_K_M), but it turned a one-stream greedy answer on SmolLM2 away
# from the float32 model's (tests/test_cpu_decode.py), so a single stream keeps int16.
# Rows from which a many-row matmul of a weight with no oneDNN copy dequantizes it into a scratch for oneDNN's
# bfloat16 GEMM (models/cpu_code_dequantize.h) instead of taking the code kernel, where oneDNN runs bfloat16
# GEMMs (AVX-512): the code kernel's integer sums are compute-bound past a few rows, the scratch costs one pass
# over the codes. Timed on random 4- to 8-bit tiles of 2048 x 640 to 8192 x 2048, 2 threads, Sapphire Rapids (a
# script beside code_matmul and dequantized_mm): 0.22 against 0.35 ms at 32 rows, even at 64, 2.3-2.9x at 256.
DEQUANT_MIN_ROWS = 64
PACK_ROWS = 4096  # a multiple of the packing's row blocks


# GGUF type name -> (bytes per 32-weight block, code planes along K).
INT4_MAPPABLE = {"Q4_0": (18, 1), "Q4_1": (20, 1), "Q8_0": (34, 2)}


@dataclass
class BlockCodes:
    """A [rows, cols] GGUF tensor as 4-bit codes: value = (code - 8) * scale + zero per 32-code group,
    summed over the `planes` code planes laid side by side along K."""

    codes: np.ndarray  # [rows, planes * cols] uint8 in 0..15
    scale: np.ndarray  # [rows, planes * cols / 32] float32
    zero: np.ndarray  # [rows, planes * cols / 32] float32
    planes: int
    qtype: str

    @property
    def rows(self) -> int:
        return self.codes.shape[0]

    def dequantize(self) -> np.ndarray:
        """float32 [rows, cols]: the planes' affine values summed (the function the int4 kernel computes)."""
        rows, width = self.codes.shape
        groups = self.codes.reshape(rows, -1, GROUP_SIZE).astype(np.float32) - 8.0
        values = (groups * self.scale[..., None] + self.zero[..., None]).reshape(rows, self.planes, -1)
        return values.sum(axis=1)

    def dequantize_torch(self) -> torch.Tensor:
        """dequantize() in torch: the same float32 values (the same operations in the same order), on the
        process's threads instead of numpy's one (3 s of SmolLM2's start-up on a busy 2-core machine)."""
        rows, _ = self.codes.shape
        groups = torch.from_numpy(self.codes).view(rows, -1, GROUP_SIZE).float().sub_(8.0)
        values = groups.mul_(torch.from_numpy(self.scale)[..., None]).add_(torch.from_numpy(self.zero)[..., None])
        values = values.view(rows, self.planes, -1)
        return values[:, 0] if self.planes == 1 else values.sum(dim=1)

    def take_rows(self, order: np.ndarray) -> "BlockCodes":
        return BlockCodes(self.codes[order], self.scale[order], self.zero[order], self.planes, self.qtype)


def code_mappable(qtype: str, cols: int) -> bool:
    """Whether decode_blocks maps a tensor of this type and row width to codes."""
    if qtype in kquant_codes.BLOCK_BYTES:
        return cols % kquant_codes.QK_K == 0
    if qtype in small_block_codes.BLOCK_BYTES:
        return cols % small_block_codes.BLOCK_WEIGHTS[qtype] == 0
    return qtype in INT4_MAPPABLE and cols % GROUP_SIZE == 0


def decode_blocks(raw: np.ndarray, qtype: str, rows: int, cols: int) -> BlockCodes | None:
    """GGUF block bytes [rows, bytes_per_row] -> BlockCodes, or None for a type without an int4 mapping."""
    if not code_mappable(qtype, cols):
        return None
    if qtype in kquant_codes.BLOCK_BYTES:
        return BlockCodes(*kquant_codes.decode(raw, qtype, rows, cols), qtype)
    if qtype in small_block_codes.BLOCK_BYTES:
        return BlockCodes(*small_block_codes.decode(raw, qtype, rows, cols), qtype)
    block_bytes, planes = INT4_MAPPABLE[qtype]
    blocks = np.ascontiguousarray(raw).reshape(rows, cols // GROUP_SIZE, block_bytes)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if qtype == "Q8_0":
        u = blocks[..., 2:] ^ np.uint8(0x80)  # q + 128 (0..255): the int8's sign bit flipped, no widening
        lo, hi = u & np.uint8(15), u >> np.uint8(4)
        codes = np.concatenate([lo.reshape(rows, cols), hi.reshape(rows, cols)], axis=1)
        scale = np.concatenate([d, 16.0 * d], axis=1)
        zero = np.concatenate([8.0 * d, np.zeros_like(d)], axis=1)
        return BlockCodes(codes, scale, zero, planes, qtype)
    qs = blocks[..., -16:]  # 16 bytes: weights 0..15 in the low nibbles, 16..31 in the high ones
    codes = np.concatenate([qs & 15, qs >> 4], axis=-1).reshape(rows, cols)
    if qtype == "Q4_0":
        return BlockCodes(codes, d, np.zeros_like(d), planes, qtype)
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    return BlockCodes(codes, d, m + 8.0 * d, planes, qtype)


# A grouped record's bytes past its codes: kSuper's 16 sc and 16 m, kHalves' 32 int8 scales; 8 of its
# super-block's header (64 bytes a super-block: d and dmin, or d and 32 zero bytes), 4 for 3-bit kHalves records
# (their header: d alone).
SUPER_AFFINE_BYTES = 40


def record_code_bytes(bits: int) -> int:
    """A record's bytes of codes (and fifth, sixth bits): 3-bit codes sit in 4-bit nibbles."""
    return (4 if bits == 3 else bits) * 64


def grouped_record_bytes(bits: int) -> int:
    """A kSuper or kHalves record's size: its codes, its integers, its share of the super-block's header."""
    return record_code_bytes(bits) + (SUPER_AFFINE_BYTES - 4 if bits == 3 else SUPER_AFFINE_BYTES)


def tile_code_bytes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Unsigned codes [N, K] uint8 (0..7 or 0..15, 0..31, 0..63 or 0..255) as the records' code bytes [N / 16,
    K / 32, record_code_bytes(bits)]: chunks of 16 columns' pairs of k (3- and 4-bit: pair q in the low nibbles,
    q + 8 in the high ones; 5-bit: then a 32-bit mask of pair q's fifth bits and one of pair q + 8's per chunk, bit
    2c + j; 6-bit: then per pair of chunks 2m, 2m + 1 32 bytes of their high two bits, byte i: chunk 2m's byte i's
    low nibble's in bits 0-1, chunk 2m + 1's in 2-3, their high nibbles' in 4-5 and 6-7)."""
    n, k = codes.shape
    groups = k // GROUP_SIZE
    # [tile, column, block, pair of k, k in pair] -> [tile, block, pair, column, k in pair]
    tiled = codes.reshape(n // 16, 16, groups, 16, 2).permute(0, 2, 3, 1, 4)
    masks = []
    if bits == 5:
        bit_values = torch.tensor([1 << i for i in range(8)], dtype=torch.uint8)
        mask = ((tiled >> 4) & 1).reshape(n // 16, groups, 16, 4, 8).mul(bit_values).sum(-1, dtype=torch.uint8)
        masks.append(mask.reshape(n // 16, groups, 2, 8, 4).transpose(2, 3).reshape(n // 16, groups, 64))
        tiled = tiled & 15
    if bits == 6:
        high = (tiled >> 4).reshape(n // 16, groups, 2, 4, 2, 32)  # [tile, block, lo|hi, m, chunk in pair, byte]
        plane = (high[:, :, 0, :, 0] | (high[:, :, 0, :, 1] << 2)
                 | (high[:, :, 1, :, 0] << 4) | (high[:, :, 1, :, 1] << 6))
        masks.append(plane.reshape(n // 16, groups, 128))
        tiled = tiled & 15
    if bits != 8:
        tiled = tiled[:, :, :8] | (tiled[:, :, 8:] << 4)
    parts = [tiled.reshape(n // 16, groups, -1)] + masks
    return torch.cat(parts, dim=-1) if len(parts) > 1 else parts[0]


@dataclass
class TiledCodes:
    """The same codes laid out for the compiled code kernel (models/cpu_code_matmul.h): an unsigned code per weight
    (4 bits; two planes joined: 5 bits where the high plane is one bit, as Q5_0's, else 8), value = scale * code +
    zero per 32-weight block (zero = -2^(bits-1) scale, not stored, for symmetric types), scale and zero
    float16 (GGUF's own precision), 16 output rows to a tile, and per tile and block one record: the codes, then
    the 16 rows' scales, then their zeros. Q4_K, Q5_K, Q6_K and Q3_K matrices keep their own integers instead
    (is_super, is_halves: models/kquant_tiles.py)."""

    # uint8 [N / 16, K / 32, bits * 64 + 64] (5 bits: 256 bytes of nibbles, 64 of fifth bits), or bits * 64 + 32
    # where a symmetric type's zeros follow from its scales (has_zeros), or grouped_record_bytes(bits) (is_super;
    # 6 and 3 bits: is_halves)
    blocks: torch.Tensor
    bits: int
    # The matrix's last rows in records of their own kind, after blocks' rows (a fused q/k/v whose v is another type
    # than q and k: one record kind for all would widen q and k to v's codes; models/gguf_tiles.py tiles_of_parts).
    # Its own tail is None. Every reader of blocks and bits (the kernels' callers, the weight cache) takes it too.
    tail: "TiledCodes | None" = None

    @property
    def out_features(self) -> int:
        return (self.blocks.shape[0] + (self.tail.blocks.shape[0] if self.tail is not None else 0)) * 16

    def head(self) -> "TiledCodes":
        """The rows in blocks alone (the whole matrix where there is no tail)."""
        return TiledCodes(self.blocks, self.bits) if self.tail is not None else self

    def pieces(self) -> list["TiledCodes"]:
        """The matrix's pieces in row order, each in one record kind: what a kernel call takes, joined by columns."""
        return [self] if self.tail is None else [self.head(), self.tail]

    @classmethod
    def from_codes(cls, block: BlockCodes, bits: int | None = None, zeros: bool | None = None) -> "TiledCodes":
        """Packed in torch (its copies run on the process's threads: part of a fresh start's load). `bits` and
        `zeros` (None: as the codes allow) hold the layout of a matrix packed a slice of rows at a time."""
        n, width = block.codes.shape
        k = width // block.planes
        groups = k // GROUP_SIZE
        codes = torch.from_numpy(block.codes)
        if block.planes == 1:
            bits = 4
            scale, zero = block.scale, block.zero - 8.0 * block.scale
        else:  # two nibble planes join into one code, plane 1's scale is 16x plane 0's: 5 bits where every hi
            # code is 0 or 1 (Q5_0, Q5_1, Q5_K), else 8 (Q8_0, Q6_K, IQ4)
            hi = codes[:, k:]
            five = int(hi.max()) <= 1
            if bits is None:
                bits = 5 if five else 8
            elif bits == 5 and not five:
                raise ValueError("5-bit tiles asked for codes past 31")
            codes = codes[:, :k] | (hi << 4)
            s0, s1 = block.scale[:, :groups], block.scale[:, groups:]
            if not np.array_equal(s1, 16.0 * s0):
                raise ValueError("two code planes whose scales are not 1 : 16")
            scale = s0
            zero = block.zero[:, :groups] - 8.0 * s0 + block.zero[:, groups:] - 8.0 * s1

        def per_tile(values: np.ndarray) -> torch.Tensor:  # [tile, block, 16 columns] float16 as bytes
            half = torch.from_numpy(values).to(torch.float16).view(n // 16, 16, groups).transpose(1, 2)
            return half.contiguous().view(torch.uint8)

        parts = [tile_code_bytes(codes, bits)]
        scale16 = scale.astype(np.float16).astype(np.float32)
        symmetric = np.array_equal(zero.astype(np.float16).astype(np.float32), -float(1 << (bits - 1)) * scale16)
        if zeros is None:
            zeros = not symmetric
        elif not zeros and not symmetric:
            raise ValueError("tiles without zeros asked for codes whose zeros do not follow from their scales")
        if not zeros:
            # A symmetric type (Q4_0, Q5_0, Q8_0, IQ4, Q6_K re-coded): its zeros follow from its scales, not stored
            return cls(torch.cat([*parts, per_tile(scale)], dim=-1), bits)
        return cls(torch.cat([*parts, per_tile(scale), per_tile(zero)], dim=-1), bits)

    @property
    def has_zeros(self) -> bool:
        """Whether the records hold float16 zeros (else zero = -2^(bits-1) scale: a symmetric type's, or made from
        a super-block's integers: is_super)."""
        return self.blocks.shape[2] == self.bits * 64 + 64

    @property
    def is_super(self) -> bool:
        """Q4_K/Q5_K super-block records (cpu_code_matmul.h's kSuper): the file's integer sub-block scales and mins
        under each super-block's float16 d and dmin (models/kquant_tiles.py makes them)."""
        return self.bits in (4, 5) and self.blocks.shape[2] == self.bits * 64 + SUPER_AFFINE_BYTES

    @property
    def is_halves(self) -> bool:
        """Q6_K's and Q3_K's own records (cpu_code_matmul.h's kHalves): codes u = q + 2^(bits-1) (6 bits; 3 bits
        in 4-bit nibbles), an int8 scale per 16 weights under each super-block's float16 d, grouped as is_super's
        (models/kquant_tiles.py makes them)."""
        return self.bits in (3, 6)

    @property
    def nbytes(self) -> int:
        return self.blocks.numel() + (self.tail.nbytes if self.tail is not None else 0)

    def _codes(self) -> torch.Tensor:
        """The unsigned codes [N, K] uint8."""
        tiles, groups, _ = self.blocks.shape
        grouped = self.is_super or self.is_halves
        records = self._super_parts()[0] if grouped else self.blocks  # [tile, block, codes ...]
        raw = records[..., :512 if self.bits == 8 else 256].reshape(tiles, groups, -1, 16, 2)
        if self.bits != 8:
            raw = torch.cat([raw & 15, raw >> 4], dim=2)
        if self.bits == 5:  # [tile, block, q, lo|hi, 4 bytes] masks -> [tile, block, pair, column, k in pair] bits
            masks = records[..., 256:320].reshape(tiles, groups, 8, 2, 4).transpose(2, 3).reshape(tiles, groups, 16, 4)
            bits = (masks[..., None] >> torch.arange(8, dtype=torch.uint8)) & 1
            raw = raw | (bits.reshape(tiles, groups, 16, 16, 2) << 4)
        if self.bits == 6:  # per chunk pair m, byte i: bits 2 * (chunk in pair) + 4 * (high nibble) of each code
            plane = records[..., 256:384].reshape(tiles, groups, 1, 4, 1, 32)
            shifts = torch.tensor([[0, 2], [4, 6]], dtype=torch.uint8).reshape(1, 1, 2, 1, 2, 1)
            high = ((plane >> shifts) & 3).reshape(tiles, groups, 16, 16, 2)  # [.., lo|hi, m, chunk in pair, byte]
            raw = raw | (high << 4)
        return raw.permute(0, 3, 1, 2, 4).reshape(tiles * 16, groups * GROUP_SIZE)

    def _halves(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """kHalves records' (signed codes q = u - 2^(bits-1) [N, K] int32, int8 scales [N, K / 16] int32, d
        [N, K / 256] float32): w = (d * sc) * q."""
        tiles, groups, _ = self.blocks.shape
        _, ints, header = self._super_parts()  # ints: [tile, block, 16 first-half scales | 16 last-half]
        scales = ints.contiguous().view(torch.int8).reshape(tiles, groups, 2, 16).permute(0, 3, 1, 2)
        d = header[..., :16].float().transpose(1, 2).reshape(tiles * 16, groups // 8)
        return self._codes().int() - (1 << (self.bits - 1)), scales.reshape(tiles * 16, groups * 2).int(), d

    def _codes_and_affine(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(unsigned codes [N, K] uint8, scale and zero [N, K / 32] float32): value = scale * code + zero. Not for
        kHalves records (two scales a block: _halves)."""
        if self.is_halves:
            raise ValueError("6- and 3-bit records hold two scales a block: _halves")
        tiles, groups, _ = self.blocks.shape
        code_bytes = self.bits * 64
        codes = self._codes()

        def affine(at: int) -> torch.Tensor:
            return (self.blocks[..., at:at + 32].contiguous().view(torch.float16).float().transpose(1, 2)
                    .reshape(tiles * 16, groups))

        if self.is_super:
            scale, zero = self._super_affine()
        else:
            scale = affine(code_bytes)
            zero = affine(code_bytes + 32) if self.has_zeros else -float(1 << (self.bits - 1)) * scale
        return codes, scale, zero

    def _super_parts(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Grouped records' three parts, each super-block's 8 records as codes, integers, header: (codes [tile,
        block, record_code_bytes] uint8, sc | m (kHalves: two int8 scales) [tile, block, 32] uint8, d | dmin
        (kHalves: d, then zeros; 3 bits: d alone) [tile, super-block, 32 or 16] float16)."""
        tiles, groups, record = self.blocks.shape
        code_bytes = record_code_bytes(self.bits)
        grouped = self.blocks.reshape(tiles, groups // 8, 8 * record)
        codes = grouped[..., :8 * code_bytes].reshape(tiles, groups, code_bytes)
        ints = grouped[..., 8 * code_bytes:8 * code_bytes + 256].reshape(tiles, groups, 32)
        return codes, ints, grouped[..., 8 * code_bytes + 256:].contiguous().view(torch.float16)

    def _super_affine(self) -> tuple[torch.Tensor, torch.Tensor]:
        """kSuper records' scale d * sc and zero -(dmin * m), [N, K / 32] float32: exact (a float16 times a 6-bit
        integer)."""
        tiles, groups, _ = self.blocks.shape
        _, ints, header = self._super_parts()
        ints = ints.float()  # [tile, block, sc of 16 columns | m of 16 columns]
        header = header.float().repeat_interleave(8, dim=1)  # [tile, block, 16 d | 16 dmin]
        scale = header[..., :16] * ints[..., :16]
        zero = -(header[..., 16:] * ints[..., 16:])
        return (scale.transpose(1, 2).reshape(tiles * 16, groups), zero.transpose(1, 2).reshape(tiles * 16, groups))

    def to_block_codes(self) -> BlockCodes:
        """The same weights as BlockCodes (one plane of 4-bit codes, or two for 8-bit ones): what torch's int4
        pack is made from. kHalves records take 8-bit codes per 32 weights as the Python path decodes Q6_K
        (kquant_codes.recode_q6_k) and Q3_K (q3_k_planes). A tail's rows join as stack_parts joins parts."""
        if self.tail is not None:
            n = self.blocks.shape[0] * 16
            joined = stack_parts([(slice(0, n), self.head().to_block_codes()),
                                  (slice(n, self.out_features), self.tail.to_block_codes())], self.out_features)
            assert joined is not None
            return joined
        if self.is_halves:
            from stallfree.node_daemon.models import kquant_codes

            q, sc, d = (t.numpy() for t in self._halves())
            n = q.shape[0]
            eight_bit = kquant_codes.recode_q6_k if self.bits == 6 else kquant_codes.q3_k_planes
            planes, scale, zero = eight_bit(q.reshape(-1, 256), sc.reshape(-1, 16), d.reshape(-1).astype(np.float32))
            return BlockCodes(*kquant_codes.as_block_codes(n, planes, scale, zero), 2, "tiles")
        codes, scale, zero = (t.numpy() for t in self._codes_and_affine())
        if self.bits == 4:  # (u - 8) s + (z + 8s) = s u + z
            return BlockCodes(np.ascontiguousarray(codes), scale, zero + 8.0 * scale, 1, "tiles")
        # u = lo + 16 hi: (lo - 8) s + (z + 8s) + (hi - 8) 16s + 128s = s u + z, or the 128s moved onto the lo
        # plane. The int4 kernel rounds scales and zeros to bfloat16: 128s rounds as 16s does, so the hi plane is
        # exact either way, and of the lo plane's two zeros the smaller rounds least (Q8_0, z = -128s: 8s).
        moved = np.abs(zero + 136.0 * scale) < np.abs(zero + 8.0 * scale)
        lo_zero = np.where(moved, zero + 136.0 * scale, zero + 8.0 * scale)
        hi_zero = np.where(moved, 0.0, 128.0 * scale).astype(np.float32)
        return BlockCodes(np.concatenate([codes & 15, codes >> 4], axis=1), np.concatenate([scale, 16.0 * scale], 1),
                          np.concatenate([lo_zero, hi_zero], 1), 2, "tiles")

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """float32 [len(ids), K]: the rows of these ids (an embedding lookup in its codes; the compiled forward's
        code_rows computes the same values)."""
        if self.tail is not None:
            raise ValueError("rows: an embedding's tiles have no tail")
        ids = ids.reshape(-1).long()
        pick = torch.arange(ids.numel()) * 16 + ids % 16
        if self.is_halves:
            return TiledCodes(self.blocks.index_select(0, ids // 16), self.bits).dequantize()[pick]
        codes, scale, zero = TiledCodes(self.blocks.index_select(0, ids // 16), self.bits)._codes_and_affine()
        values = codes[pick].view(ids.numel(), -1, GROUP_SIZE).float() * scale[pick][..., None] + zero[pick][..., None]
        return values.view(ids.numel(), -1)

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K]: what the kernel multiplies by (tests)."""
        if self.tail is not None:
            return torch.cat([self.head().dequantize(), self.tail.dequantize()])
        if self.is_halves:  # (d * sc) * q, as gguf computes Q6_K and Q3_K
            q, sc, d = self._halves()
            n = q.shape[0]
            scale = d.repeat_interleave(16, dim=1) * sc.float()  # [N, K / 16]
            return (scale[..., None] * q.view(n, -1, 16).float()).reshape(n, -1)
        codes, scale, zero = self._codes_and_affine()
        n = codes.shape[0]
        values = codes.view(n, -1, GROUP_SIZE).float() * scale[..., None] + zero[..., None]
        return values.reshape(n, -1)


class Int4Weight:
    """A GGUF weight [out_features, in_features] served from its codes: the code kernel's tiles, and torch's int4
    pack (`_weight_int4pack_mm_for_cpu`, in one dtype) made from them at first use: the Python path's, needed only
    until the compiled extension is loaded (a start with the extension cached never makes it)."""

    def __init__(self, codes: BlockCodes, dtype: torch.dtype) -> None:
        if codes.rows % 16:
            raise ValueError(f"the int4 kernel needs a multiple of 16 output rows, got {codes.rows}")
        self.tiles = TiledCodes.from_codes(codes)
        self.planes, self.out_features, self.dtype = codes.planes, codes.rows, dtype
        self._pack: tuple[torch.Tensor, torch.Tensor] | None = None  # (packed, scales_and_zeros), one attribute:
        self._pack_released = False  # swapped whole, so a reader on another thread sees both or neither
        # (the compiled code kernel, up to how many rows it takes this weight, from how many its activations are
        # int8): set for its model by the runner that serves it (models/cpu_decode.py publish_code_kernel), so two
        # engines in one process never switch each other's kernels; None until then (torch's int4 kernel).
        self.code_kernel: tuple | None = None
        # (the library's dequantized_mm, from how many rows): many-row matmuls where no oneDNN copy is kept, set
        # with code_kernel where oneDNN runs bfloat16 GEMMs (dequantize_min_rows); None: the code kernel takes them.
        self.dequantized: tuple | None = None

    @classmethod
    def from_tiles(cls, tiles: TiledCodes, planes: int, dtype: torch.dtype) -> "Int4Weight":
        """One from its tiles alone (models/weight_cache.py keeps them)."""
        weight = cls.__new__(cls)
        weight.tiles, weight.planes, weight.out_features, weight.dtype = tiles, planes, tiles.out_features, dtype
        weight._pack, weight._pack_released, weight.code_kernel, weight.dequantized = None, False, None, None
        return weight

    def _torch_pack(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """torch's int4 pack, made from the tiles at first use (None once released)."""
        pack = self._pack
        if pack is None and not self._pack_released:
            codes = self.tiles.to_block_codes()
            n = codes.rows
            # The kernel packs each row on its own: converted PACK_ROWS rows at a time, the int32 copy it takes is
            # never the whole matrix (226 MB for SmolLM2's tied head).
            packed = torch.cat([torch.ops.aten._convert_weight_to_int4pack_for_cpu(
                torch.from_numpy(codes.codes[i:i + PACK_ROWS].astype(np.int32)), 1) for i in range(0, n, PACK_ROWS)])
            # [groups, N, 2]: (scale, zero) of every group of every output row.
            scales = torch.from_numpy(np.stack([codes.scale, codes.zero], axis=-1)).transpose(0, 1) \
                .contiguous().to(self.dtype)
            pack = self._pack = (packed, scales)
        return pack

    @property
    def packed(self) -> torch.Tensor | None:
        pack = self._torch_pack()
        return None if pack is None else pack[0]

    @property
    def scales_and_zeros(self) -> torch.Tensor | None:
        pack = self._torch_pack()
        return None if pack is None else pack[1]

    def release_int4_pack(self) -> int:
        """Drop torch's int4 pack (made or not) once the code kernel serves every matmul of this weight (the
        compiled extension is loaded). Returns the bytes freed."""
        pack, self._pack, self._pack_released = self._pack, None, True
        return 0 if pack is None else sum(t.numel() * t.element_size() for t in pack)

    @property
    def nbytes(self) -> int:
        """The bytes a matmul of a few rows reads: the code kernel's tiles where it is in use."""
        pack = self._pack
        if self.code_kernel is not None or pack is None:
            return self.tiles.nbytes
        return sum(t.numel() * t.element_size() for t in pack)

    def code_kernel_applies(self, rows: int, any_rows: bool = False) -> bool:
        """Whether a matmul of `rows` rows takes the compiled code kernel: up to its row limit, or at any row count
        (`any_rows`: nothing else holds this weight for many rows, no oneDNN copy)."""
        kernel = self.code_kernel
        return kernel is not None and (any_rows or rows <= kernel[1])

    def matmul(self, x: torch.Tensor, float_out: bool = False, any_rows: bool = False) -> torch.Tensor:
        """x [rows, in_features] (this weight's dtype) -> [rows, out_features]: the code kernel once the compiled
        extension is loaded (up to its row limit unless `any_rows`; float32 sums when `float_out`), else torch's
        int4 kernel (in x's dtype)."""
        dequantized = self.dequantized
        tiles = self.tiles.pieces()
        if any_rows and not float_out and dequantized is not None and x.shape[0] >= dequantized[1] \
                and x.dtype == torch.bfloat16:
            x = x.contiguous()
            return torch.cat([dequantized[0](x, t.blocks) for t in tiles], dim=-1)
        if self.code_kernel_applies(x.shape[0], any_rows):
            op, _, int8_min_rows = self.code_kernel
            # an LM head's logits (float_out) take int8 from the same rows as the projections (llama.cpp's head
            # takes int8 Q8_0 activations at every row count); one stream's 1-8 rows keep int16
            outs = [op(x, t.blocks, t.bits, float_out, int8_min_rows) for t in tiles]
            return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
        pack = self._torch_pack()
        if pack is None:
            raise RuntimeError("int4 matmul: torch's int4 pack was released for the code kernel, which is not in use")
        if self.planes == 2:
            x = torch.cat([x, x], dim=-1)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, pack[0], GROUP_SIZE, pack[1])


# Rows packed at a time by tiles_from_blocks: a large matrix's decoded copies stay this size (a 262k-row embedding's
# transient planes took over a GB at once).
TILE_CHUNK_ROWS = 16384


def tiles_from_blocks(raw: np.ndarray, qtype: str, rows: int, cols: int) -> tuple[TiledCodes, int] | None:
    """decode_blocks then TiledCodes.from_codes, TILE_CHUNK_ROWS rows at a time, every slice in the first one's
    layout: (tiles, planes), or None for a type without a code mapping."""
    raw = np.asarray(raw).reshape(rows, -1)
    if qtype == "Q8_0":
        direct = q8_0_tiles(raw, rows, cols)
        if direct is not None:
            return direct, 2
    first = decode_blocks(raw[:TILE_CHUNK_ROWS], qtype, min(rows, TILE_CHUNK_ROWS), cols)
    if first is None:
        return None
    head = TiledCodes.from_codes(first)
    parts, zeros = [head.blocks], head.has_zeros
    for start in range(TILE_CHUNK_ROWS, rows, TILE_CHUNK_ROWS):
        block = decode_blocks(raw[start:start + TILE_CHUNK_ROWS], qtype, min(TILE_CHUNK_ROWS, rows - start), cols)
        try:
            parts.append(TiledCodes.from_codes(block, head.bits, zeros).blocks)
        except ValueError:  # a slice whose codes the first slice's layout cannot hold: the whole matrix at once
            whole = decode_blocks(raw, qtype, rows, cols)
            return TiledCodes.from_codes(whole), whole.planes
    return TiledCodes(torch.cat(parts) if len(parts) > 1 else parts[0], head.bits), first.planes


def q8_0_tiles(raw: np.ndarray, rows: int, cols: int) -> TiledCodes | None:
    """Q8_0 blocks [rows, cols / 32 * 34] straight into TiledCodes' 8-bit records, the bytes decode_blocks and
    from_codes make, without their intermediate arrays: a 2-byte float16 scale d and 32 int8 codes per block
    are the record's code q + 128 and its scale as they are (zero -128 d, not stored). Gemma 3's 262k-row tied
    embedding: 0.1 s instead of 0.8. None where -128 d overflows float16 (from_codes then stores zeros)."""
    if rows % 16 or cols % GROUP_SIZE or raw.ctypes.data % 2:
        return None
    groups, tiles = cols // GROUP_SIZE, rows // 16
    with warnings.catch_warnings():  # the file's read-only mapping: only read here
        warnings.simplefilter("ignore", UserWarning)
        # 2-byte words: the scale, then 16 pairs of codes (a row's blocks are 34 bytes: every word aligned)
        words = torch.from_numpy(np.ascontiguousarray(raw)).view(torch.int16).view(rows, groups, 17)
    if float(words[..., 0].view(torch.float16).abs().max()) * 128.0 > float(torch.finfo(torch.float16).max):
        return None
    out = torch.empty(tiles, groups, 8 * 64 + 32, dtype=torch.uint8)
    # [tile, column, block, pair of k] -> [tile, block, pair, column], as from_codes lays them; code q + 128 is the
    # int8's sign bit flipped in both bytes of a pair
    out[..., :512].view(torch.int16).view(tiles, groups, 16, 16).copy_(
        words[..., 1:].view(tiles, 16, groups, 16).permute(0, 2, 3, 1)).bitwise_xor_(-0x7F80)
    out[..., 512:].view(torch.int16).copy_(words[..., 0].view(tiles, 16, groups).transpose(1, 2))
    return TiledCodes(out, 8)


def dequantize_min_rows() -> int:
    """DEQUANT_MIN_ROWS where oneDNN runs bfloat16 GEMMs on this CPU's tier, else 0 (never: the code kernel). 0 too
    where the code kernel's int8 products outrun oneDNN's GEMM (CpuTier.int8_outruns_onednn) and are switched on."""
    from stallfree.node_daemon.models.cpu_tier import cpu_tier

    tier = cpu_tier()
    if not tier.onednn_bf16 or (tier.int8_outruns_onednn and int8_switched_on()):
        return 0
    return DEQUANT_MIN_ROWS


def int8_switched_on() -> bool:
    """STALLFREE_CPU_INT8 is not 0: the code kernel may take int8 activations (where its tier has them)."""
    return os.environ.get(INT8_SWITCH, "1") not in ("0", "false", "no", "off")


def int4_supported(dtype: torch.dtype, device: torch.device) -> bool:
    """The int4 CPU kernel runs bfloat16 activations here; float32 stays the dequantized reference path."""
    return device.type == "cpu" and dtype == torch.bfloat16


def as_two_planes(block: BlockCodes) -> BlockCodes:
    """A one-plane BlockCodes as two (its codes in the lo plane, a hi plane of zero codes whose value
    (0 - 8) * 16s + 128s is 0): 8-bit codes in TiledCodes. For fused projections whose parts differ, as Q4_K_M's
    q and k (Q4_K) beside a Q6_K v."""
    if block.planes == 2:
        return block
    return BlockCodes(np.concatenate([block.codes, np.zeros_like(block.codes)], axis=1),
                      np.concatenate([block.scale, 16.0 * block.scale], axis=1),
                      np.concatenate([block.zero, 128.0 * block.scale], axis=1), 2, block.qtype)


def stack_parts(parts: list[tuple[slice, BlockCodes]], rows: int) -> BlockCodes | None:
    """One BlockCodes for a fused projection from its row parts (q, k, v or gate, up); None unless every row
    is covered. Parts of one and two planes are joined as two (the one-plane parts widened to 8-bit codes)."""
    if not parts:
        return None
    if len({p.planes for _, p in parts}) > 1:
        parts = [(rows_slice, as_two_planes(p)) for rows_slice, p in parts]
    ordered = sorted(parts, key=lambda item: item[0].start or 0)
    covered = 0
    for rows_slice, part in ordered:
        if (rows_slice.start or 0) != covered:
            return None
        covered += part.rows
    if covered != rows:
        return None
    codes = [p for _, p in ordered]
    return BlockCodes(np.concatenate([p.codes for p in codes]), np.concatenate([p.scale for p in codes]),
                      np.concatenate([p.zero for p in codes]), codes[0].planes,
                      "+".join(dict.fromkeys(p.qtype for p in codes)))
