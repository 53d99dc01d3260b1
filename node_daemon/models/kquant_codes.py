"""GGUF's K-quants (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K) as code planes of 32-weight groups (models/quantized.py's
BlockCodes form: value = (code - 8) * scale + zero per group, summed over the planes).

The byte layouts are read as the installed gguf package's dequantize_blocks read them (gguf/quants.py), with its
own get_scale_min for the packed 6-bit scales and mins. A 256-weight super-block holds a float16 d (and dmin) and
per-sub-block integer scales:

    Q4_K  w = d*sc*q - dmin*m, q 4 bits, (sc, m) 6 bits per 32   -> one plane: scale d*sc, zero 8*d*sc - dmin*m
                                                                    (exact)
    Q5_K  the same with q 5 bits                                  -> two planes of the 8-bit code u = q: lo = u & 15
                                                                    (scale s, zero z + 8s), hi = u >> 4 (scale 16s,
                                                                    zero 128s), s = d*sc, z = -dmin*m (exact)
    Q6_K  w = d*sc*q, q in -32..31, sc int8 per 16 weights        -> not affine per 32 where the two 16-scales
                                                                    differ: RE-CODED to an 8-bit code per 32
    Q3_K  w = d*sc*q, q in -4..3, sc 6 bits (-32..31) per 16      -> the integer P = sc*q (-124..128) as an 8-bit
                                                                    code u = 128 - P, scale -d (exact: Q8_0's form)
    Q2_K  w = d*sc*q - dmin*m, q 2 bits, (sc, m) 4 bits per 16    -> two offsets per 32: RE-CODED to an 8-bit code
                                                                    per 32 on a grid over the block's range

Q6_K's re-coding: per 32 weights the integers P = sc*q (w = d*P). Where both 16-scales are equal in magnitude the
block is exact (s = d*|sc|, u = P/|sc| + 128). Otherwise the grid is a quarter of the larger 16-scale's step,
s = d*sc_larger/4: that half is exact (u = 4q + 128 spans 0..252) and the other half, whose |sc| is smaller, fits
the same 256 levels rounded (exact where 4*sc_smaller*q/sc_larger is whole): at most s/2 = 1/8 of the block's
larger 6-bit step d*max|sc| per weight, RMS 0.05 of it (Q6_K's own rounding is up to half a step, RMS 0.29;
tests/test_kquants.py measures both). A grid spread over the range (s = range/255) would round both halves: RMS
0.07. The codes take Q8_0's form w = s*(u - 128) (zeros 8s and 0: multiples of s, so rounding the scales to
bfloat16 for torch's int4 kernel adds no offset error).

Q2_K's re-coding: a 32-weight block's two halves differ in scale and offset (d*sc, dmin*m), so no one affine
grid holds both exactly; its 8-bit grid spans the block's decoded values (s = (max - min)/255, zero = min), each
within s/2 = a 510th of the block's range (Q2_K's own step is a third of a half's range).

These planes are the Python path's codes. Where they are laid out in the compiled kernel's per-32 records
(quantized.TiledCodes.from_codes) scale and zero are float16: d*sc has up to 17 significant bits, so there K-quant
scales and zeros are rounded to float16 (a half ulp, 2^-11, of each: under 1% of a 4-bit step). A matrix whose parts
are all Q4_K or Q5_K (or, on a tier with AVX512-VNNI, all Q6_K or all Q3_K) does not take that path when it is
loaded from a file: kquant_tiles.py keeps the file's integers (super-block, 6-bit and 3-bit records), and the kernel
makes d*sc and dmin*m exactly. Q6_K's re-coding and Q3_K's 8-bit codes here serve the other tiers and a part beside
another type (a Q4_K_M's Q6_K v beside Q4_K q and k).
"""
from __future__ import annotations

import numpy as np

QK_K = 256  # weights per super-block
BLOCK_BYTES = {"Q2_K": 84, "Q3_K": 110, "Q4_K": 144, "Q5_K": 176, "Q6_K": 210}
PLANES = {"Q2_K": 2, "Q3_K": 2, "Q4_K": 1, "Q5_K": 2, "Q6_K": 2}
# Weights decoded at a time: bounds the temporaries (a 49k x 2048 embedding would take several hundred MB at
# start-up) and keeps them in cache.
_CHUNK_WEIGHTS = 1 << 19


def decode(raw: np.ndarray, qtype: str, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """Block bytes [rows, bytes_per_row] of a K-quant -> (codes [rows, planes*cols] uint8 in 0..15,
    scale and zero [rows, planes*cols/32] float32, planes)."""
    planes = PLANES[qtype]
    groups = cols // 32
    codes = np.empty((rows, planes * cols), np.uint8)
    scale = np.empty((rows, planes * groups), np.float32)
    zero = np.empty((rows, planes * groups), np.float32)
    blocks = np.ascontiguousarray(raw).reshape(rows, cols // QK_K, BLOCK_BYTES[qtype])
    decode_chunk = {"Q2_K": _q2_k, "Q3_K": _q3_k, "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k}[qtype]
    chunk_rows = max(1, _CHUNK_WEIGHTS // cols)
    for start in range(0, rows, chunk_rows):
        part = blocks[start:start + chunk_rows]
        n = part.shape[0]
        c, s, z = decode_chunk(part.reshape(-1, BLOCK_BYTES[qtype]))
        codes[start:start + n], scale[start:start + n], zero[start:start + n] = as_block_codes(n, c, s, z)
    return codes, scale, zero, planes


def as_block_codes(rows: int, c: np.ndarray, s: np.ndarray, z: np.ndarray) \
        -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A decoder's per-super-block planes (c [rows * supers, planes, 256]; s, z [rows * supers, planes, 8]) as
    BlockCodes' arrays: the planes side by side along K."""
    planes = c.shape[1]
    codes = c.reshape(rows, -1, planes, QK_K).transpose(0, 2, 1, 3).reshape(rows, -1)
    scale = s.reshape(rows, -1, planes, 8).transpose(0, 2, 1, 3).reshape(rows, -1)
    zero = z.reshape(rows, -1, planes, 8).transpose(0, 2, 1, 3).reshape(rows, -1)
    return codes, scale, zero


def _f16(two_bytes: np.ndarray) -> np.ndarray:
    return two_bytes.copy().view(np.float16)[:, 0].astype(np.float32)


def _sub_scales(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K: (d*sc, dmin*m) per 32-weight sub-block, [n, 8] float32, computed as gguf computes them."""
    from gguf.quants import Q4_K

    d, dmin = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])
    sc, m = Q4_K.get_scale_min(np.ascontiguousarray(blocks[:, 4:16]))
    return d[:, None] * sc.astype(np.float32), dmin[:, None] * m.astype(np.float32)


def low_nibbles_then_high(qs: np.ndarray) -> np.ndarray:
    """[n, 128] bytes -> [n, 256] 4-bit values: each 32 bytes give one sub-block in their low nibbles, the next
    sub-block in their high ones."""
    q = qs.reshape(-1, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    return (q & 15).reshape(-1, QK_K)


def _q4_k(blocks: np.ndarray):
    s, dm = _sub_scales(blocks)
    codes = low_nibbles_then_high(blocks[:, 16:144])
    return codes[:, None], s[:, None], (8.0 * s - dm)[:, None]  # (q - 8)*s + 8s - dm = s*q - dm


def q5_k_fifth_bits(blocks: np.ndarray) -> np.ndarray:
    """Q5_K blocks [n, 176] -> [n, 256] fifth bits (0 or 1): sub-block i's is bit i of the 32 qh bytes."""
    qh = blocks[:, 16:48].reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
    return (qh & 1).reshape(-1, QK_K)


def _q5_k(blocks: np.ndarray):
    s, dm = _sub_scales(blocks)
    lo = low_nibbles_then_high(blocks[:, 48:176])
    return _unsigned_as_planes(lo, q5_k_fifth_bits(blocks), s, -dm)


def _unsigned_as_planes(lo, hi, s, z):
    """w = s*u + z, u = lo + 16*hi: lo plane (scale s, zero z + 8s), hi plane (scale 16s, zero 128s)."""
    codes = np.stack([lo, hi], axis=1)
    return codes, np.stack([s, 16.0 * s], axis=1), np.stack([z + 8.0 * s, 128.0 * s], axis=1)


def q6_k_integers(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q6_K blocks [n, 210] -> (q [n, 256] int32 in -32..31, sc [n, 16] int32 (one per 16 weights), d [n]
    float32): w = d * sc * q."""
    n = blocks.shape[0]
    ql = blocks[:, 0:128].reshape(n, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    qh = blocks[:, 128:192].reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
    q = ((ql & 15).reshape(n, QK_K) | ((qh & 3).reshape(n, QK_K) << 4)).astype(np.int32) - 32
    return q, blocks[:, 192:208].view(np.int8).astype(np.int32), _f16(blocks[:, 208:210])


def _q6_k(blocks: np.ndarray):
    return recode_q6_k(*q6_k_integers(blocks))


def recode_q6_k(q: np.ndarray, sc: np.ndarray, d: np.ndarray):
    """Q6_K's integers (q6_k_integers) re-coded to an 8-bit code per 32 weights (the module's docstring says how):
    (codes [n, 2, 256], scale and zero [n, 2, 8]), two planes."""
    n = q.shape[0]
    p = (q.reshape(n, 16, 16) * sc[:, :, None]).reshape(n, 8, 32).astype(np.float32)  # w = d * p, |p| <= 4096
    pairs = sc.reshape(n, 8, 2)
    a, b = np.abs(pairs[..., 0]), np.abs(pairs[..., 1])
    big = np.where(a >= b, pairs[..., 0], pairs[..., 1])  # the larger 16-scale, with its sign
    # Equal magnitudes: p / |sc| = +-q in -32..32, exact. Otherwise a grid of big/4 (in units of d): that half gives
    # 4q (-128..124) exactly, and the other, |p| < 32 |big|, rounds inside -127..127.
    step = np.where(a == b, np.maximum(a, 1), big / 4.0).astype(np.float32)[..., None]
    signed = np.rint(p / step).astype(np.int16)
    u = (signed + 128).astype(np.uint8).reshape(n, QK_K)
    s = d[:, None] * step[..., 0]
    # w = s*(u - 128): Q8_0's planes, lo (scale s, zero 8s) and hi (scale 16s, zero 0)
    codes = np.stack([u & 15, u >> 4], axis=1)
    return codes, np.stack([s, 16.0 * s], axis=1), np.stack([8.0 * s, np.zeros_like(s)], axis=1)


def _two_bit_values(qs: np.ndarray) -> np.ndarray:
    """[n, 64] bytes -> [n, 256] 2-bit values: each 32 bytes give four 32-weight runs, bits 0-1, 2-3, 4-5, 6-7."""
    q = qs.reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
    return (q & 3).reshape(-1, QK_K)


def q3_k_integers(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q3_K blocks [n, 110] (32 bytes of high-bit masks, 64 of 2-bit lows, 12 of packed 6-bit scales, d: gguf's
    layout) -> (q [n, 256] int32 in -4..3, sc [n, 16] int32 in -32..31 (one per 16 weights), d [n] float32):
    w = d * sc * q."""
    n = blocks.shape[0]
    low = blocks[:, 96:104].reshape(n, 1, 8) >> np.array([0, 4], np.uint8).reshape(1, 2, 1)
    high = blocks[:, 104:108].reshape(n, 1, 4) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 4, 1)
    sc = ((low.reshape(n, 16) & 15) | ((high.reshape(n, 16) & 3) << 4)).astype(np.int32) - 32
    mask = (blocks[:, 0:32].reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1
    q = _two_bit_values(blocks[:, 32:96]).astype(np.int32) - 4 * (1 - mask.reshape(n, QK_K).astype(np.int32))
    return q, sc, _f16(blocks[:, 108:110])


def _q3_k(blocks: np.ndarray):
    return q3_k_planes(*q3_k_integers(blocks))


def q3_k_planes(q: np.ndarray, sc: np.ndarray, d: np.ndarray):
    """Q3_K's integers (q3_k_integers) as the exact 8-bit code u = 128 - sc * q under the scale -d (the module's
    docstring): (codes [n, 2, 256], scale and zero [n, 2, 8]), two planes."""
    n = q.shape[0]
    p = (q.reshape(n, 16, 16) * sc[:, :, None]).reshape(n, QK_K)  # w = d * p, p in -124..128
    u = (128 - p).astype(np.uint8)  # 0..252: 128 - p, so that p = 128 (sc = -32, q = -4) fits
    s = np.repeat(-d.astype(np.float32)[:, None], 8, axis=1)  # w = -d * (u - 128)
    return _unsigned_as_planes(u & 15, u >> 4, s, -128.0 * s)


def _q2_k(blocks: np.ndarray):
    """84 bytes: 16 of packed 4-bit (sc, m), 64 of 2-bit codes, d, dmin (gguf's Q2_K layout)."""
    n = blocks.shape[0]
    packed = blocks[:, 0:16]
    d, dmin = _f16(blocks[:, 80:82]), _f16(blocks[:, 82:84])
    dl = d[:, None] * (packed & 15).astype(np.float32)
    ml = dmin[:, None] * (packed >> 4).astype(np.float32)
    q = _two_bit_values(blocks[:, 16:80]).reshape(n, 16, 16).astype(np.float32)
    w = (dl[:, :, None] * q - ml[:, :, None]).reshape(n, 8, 32)  # the values gguf decodes, in its order
    low = w.min(axis=2)
    s = (w.max(axis=2) - low) / np.float32(255)
    u = np.rint((w - low[..., None]) / np.where(s > 0, s, np.float32(1))[..., None])
    u = np.clip(u, 0, 255).astype(np.uint8).reshape(n, QK_K)
    return _unsigned_as_planes(u & 15, u >> 4, s, low)
