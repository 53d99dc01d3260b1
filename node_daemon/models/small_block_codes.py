"""GGUF's 5-bit legacy types (Q5_0, Q5_1) and the 4-bit non-linear ones (IQ4_NL, IQ4_XS) as code planes of
32-weight groups (models/quantized.py's BlockCodes form: value = (code - 8) * scale + zero per group, summed over
the planes). Every mapping is exact: the codes are the file's own integers, unsigned.

    Q5_0    w = d * (q - 16), q 5 bits                  -> u = q:  scale d, zero -16d
    Q5_1    w = d * q + m                               -> u = q:  scale d, zero m
    IQ4_NL  w = d * T[q], T llama.cpp's 16 int8 levels  -> u = T[q] + 128 (1..241): scale d, zero -128d
    IQ4_XS  the same per 32 under a 256-weight block:   -> u = T[q] + 128: scale d * (ls - 32), zero -128 scale
            d float16, ls a 6-bit integer per 32

u is written as two planes (lo = u & 15, hi = u >> 4; models/kquant_codes.py's _unsigned_as_planes), which the
code kernel's tiles join into one code of 5 bits (Q5_0, Q5_1: u < 32) or 8 (models/quantized.py TiledCodes).
Byte layouts as the installed gguf package reads them (gguf/quants.py).
"""
from __future__ import annotations

import numpy as np

# Bytes of one block, and the weights it holds.
BLOCK_BYTES = {"Q5_0": 22, "Q5_1": 24, "IQ4_NL": 18, "IQ4_XS": 136}
BLOCK_WEIGHTS = {"Q5_0": 32, "Q5_1": 32, "IQ4_NL": 32, "IQ4_XS": 256}
# llama.cpp's kvalues_iq4nl
IQ4_LEVELS = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int16)
_IQ4_CODES = (IQ4_LEVELS + 128).astype(np.uint8)  # the levels as unsigned codes


def decode(raw: np.ndarray, qtype: str, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """Block bytes [rows, bytes_per_row] -> (codes [rows, 2 * cols] uint8 in 0..15, scale and zero
    [rows, 2 * cols / 32] float32, 2 planes), the planes side by side along K."""
    groups = cols // 32
    blocks = np.ascontiguousarray(raw).reshape(rows * cols // BLOCK_WEIGHTS[qtype], BLOCK_BYTES[qtype])
    u, scale, zero = _DECODERS[qtype](blocks)  # u [rows * groups, 32]; scale, zero [rows * groups]
    u = u.reshape(rows, groups * 32)
    scale, zero = scale.reshape(rows, groups), zero.reshape(rows, groups)
    codes = np.concatenate([u & 15, u >> 4], axis=1)
    return codes, np.concatenate([scale, 16.0 * scale], 1), np.concatenate([zero + 8.0 * scale, 128.0 * scale], 1), 2


def _f16(two_bytes: np.ndarray) -> np.ndarray:
    return two_bytes.copy().view(np.float16)[:, 0].astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[n, 16] bytes -> [n, 32]: weights 0..15 in the low nibbles, 16..31 in the high ones."""
    return np.concatenate([qs & 15, qs >> 4], axis=1)


def _five_bits(blocks: np.ndarray, qh_at: int) -> np.ndarray:
    """Q5_0/Q5_1: the 5-bit codes, the fifth bit of weight j being bit j of the little-endian uint32 at qh_at."""
    qh = blocks[:, qh_at:qh_at + 4].copy().view(np.uint32)  # [n, 1]
    high = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)
    return _nibbles(blocks[:, qh_at + 4:qh_at + 20]) | (high << 4)


def _q5_0(blocks: np.ndarray):
    d = _f16(blocks[:, 0:2])
    return _five_bits(blocks, 2), d, -16.0 * d


def _q5_1(blocks: np.ndarray):
    return _five_bits(blocks, 4), _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])


def _iq4_nl(blocks: np.ndarray):
    d = _f16(blocks[:, 0:2])
    return _IQ4_CODES[_nibbles(blocks[:, 2:18])], d, -128.0 * d


def _iq4_xs(blocks: np.ndarray):
    n = blocks.shape[0]
    d = _f16(blocks[:, 0:2])
    scales_h = blocks[:, 2:4].copy().view(np.uint16)  # [n, 1]
    scales_l = blocks[:, 4:8]
    low = np.stack([scales_l & 15, scales_l >> 4], axis=2).reshape(n, 8)
    high = ((scales_h >> (2 * np.arange(8, dtype=np.uint16))) & 3).astype(np.uint8)
    scale = (d[:, None] * ((low | (high << 4)).astype(np.float32) - 32.0)).reshape(-1)  # one per 32 weights
    return _IQ4_CODES[_nibbles(blocks[:, 8:136].reshape(n * 8, 16))], scale, -128.0 * scale


_DECODERS = {"Q5_0": _q5_0, "Q5_1": _q5_1, "IQ4_NL": _iq4_nl, "IQ4_XS": _iq4_xs}
