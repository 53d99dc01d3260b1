"""GGUF block bytes made in numpy: Q4_K, Q5_K and Q6_K packed from their fields, random valid blocks of a
given weight scale, and a plain Q6_K quantizer.

gguf 0.19's quants module dequantizes the K-quants but cannot quantize them, so they are packed here, each the
inverse of gguf's own dequantize_blocks (gguf/quants.py; tests/test_kquants.py checks every packer against it).
Random blocks (codes and scales drawn directly, no float weights made) let bench/write_random_gguf.py write a
1B-parameter file in seconds on two cores: quantizing a billion float weights in numpy takes minutes.
"""
from __future__ import annotations

import numpy as np

QK_K = 256


def _f16_bytes(values: np.ndarray) -> np.ndarray:
    """[n] -> [n, 2] uint8: float16 little-endian."""
    return np.ascontiguousarray(values.astype("<f2")).view(np.uint8).reshape(-1, 2)


def pack_scale_min(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """sc, m [n, 8] 6-bit -> [n, 12]: the inverse of gguf's Q4_K.get_scale_min."""
    sc, m = sc.astype(np.uint8), m.astype(np.uint8)
    low = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    mins = m[:, :4] | ((m[:, 4:] >> 4) << 6)
    both = (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)
    return np.concatenate([low, mins, both], axis=1)


def _nibbles(q: np.ndarray) -> np.ndarray:
    """[n, 8, 32] 4-bit -> [n, 128]: sub-blocks 2j and 2j+1 in the low and high nibbles of bytes 32j..32j+31."""
    return ((q[:, 0::2] & 15) | ((q[:, 1::2] & 15) << 4)).astype(np.uint8).reshape(-1, 128)


def pack_q4_k(d, dmin, sc, m, q) -> np.ndarray:
    """d, dmin [n]; sc, m [n, 8] 0..63; q [n, 8, 32] 0..15 (w = d*sc*q - dmin*m) -> [n, 144] bytes."""
    return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), pack_scale_min(sc, m), _nibbles(q)], axis=1)


def pack_q5_k(d, dmin, sc, m, q) -> np.ndarray:
    """As pack_q4_k with q 0..31: the fifth bits of sub-block i are bit i of 32 qh bytes -> [n, 176] bytes."""
    high = ((q >> 4) & 1).astype(np.uint8) << np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
    qh = np.bitwise_or.reduce(high, axis=1)
    return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), pack_scale_min(sc, m), qh, _nibbles(q)], axis=1)


def pack_q6_k(d, sc, q) -> np.ndarray:
    """d [n]; sc [n, 16] int8, one per 16 weights; q [n, 256] 0..63 (w = d*sc*(q - 32)) -> [n, 210] bytes."""
    n = q.shape[0]
    q = q.astype(np.uint8)
    halves = q.reshape(n, 2, 2, 64)  # ql byte 64h + k: weight 128h + k low nibble, 128h + 64 + k high
    ql = (halves[:, :, 0] & 15) | ((halves[:, :, 1] & 15) << 4)
    quarters = q.reshape(n, 2, 4, 32) >> 4  # qh byte 32h + k: bits 2s of weight 128h + 32s + k
    qh = np.bitwise_or.reduce(quarters << np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1), axis=2)
    return np.concatenate([ql.reshape(n, 128), qh.reshape(n, 64).astype(np.uint8),
                           sc.astype(np.int8).view(np.uint8), _f16_bytes(d)], axis=1)


# --- random valid blocks: weights of about `std` -------------------------------------------------------------

_UNIFORM_STD_16 = np.sqrt((16 ** 2 - 1) / 12)  # a uniform code over 0..15
_UNIFORM_STD_64 = np.sqrt((64 ** 2 - 1) / 12)


def _random_bytes(rng: np.random.Generator, *shape: int) -> np.ndarray:
    return np.frombuffer(rng.bytes(int(np.prod(shape))), np.uint8).reshape(shape)


def random_blocks(qtype: str, rows: int, cols: int, rng: np.random.Generator, std: float = 0.02) -> np.ndarray:
    """[rows, bytes_per_row] valid blocks of `qtype` (Q4_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K) whose weights have about
    `std`: uniform codes, scales varied by a quarter around the one that gives `std` (signed where the type's are),
    mins centring each sub-block (Q2_K and Q3_K: random codes and scales under one d)."""
    if qtype == "Q4_0":  # d of either sign, as llama.cpp's quantizer writes it (d = signed max / -8)
        n = rows * cols // 32
        d = std / _UNIFORM_STD_16 * rng.uniform(0.75, 1.25, n) * rng.choice([-1.0, 1.0], n)
        raw = np.concatenate([_f16_bytes(d), _random_bytes(rng, n, 16)], axis=1)
    elif qtype in ("Q4_K", "Q5_K"):
        n, levels = rows * cols // QK_K, (16 if qtype == "Q4_K" else 32)
        sc = rng.integers(32, 64, (n, 8))
        d = std / np.sqrt((levels ** 2 - 1) / 12) / 48 * np.ones(n)
        d = d.astype(np.float16).astype(np.float64)
        dmin = (d * (levels - 1) / 2).astype(np.float16).astype(np.float64)  # m = sc centres q
        m = np.clip(np.rint(d[:, None] * sc * (levels - 1) / 2 / dmin[:, None]), 0, 63)
        q = _random_bytes(rng, n, 8, 32) % levels
        pack = pack_q4_k if qtype == "Q4_K" else pack_q5_k
        raw = pack(d, dmin, sc, m, q)
    elif qtype == "Q6_K":
        n = rows * cols // QK_K
        sc = rng.integers(64, 128, (n, 16)) * rng.choice([-1, 1], (n, 16))  # signed, as in llama.cpp's files
        d = np.full(n, std / _UNIFORM_STD_64 / 96)
        raw = pack_q6_k(d, sc, _random_bytes(rng, n, QK_K) & 63)
    elif qtype == "Q3_K":  # random masks, 2-bit lows and 6-bit scales (-32..31); q * sc has an RMS of about 43
        n = rows * cols // QK_K
        d = np.full(n, std / 43)
        raw = np.concatenate([_random_bytes(rng, n, 108), _f16_bytes(d)], axis=1)
    elif qtype == "Q2_K":  # random 4-bit (sc, m) and 2-bit codes; dmin = 1.5 d centres sc * q on average
        n = rows * cols // QK_K
        d = np.full(n, std / 10)
        raw = np.concatenate([_random_bytes(rng, n, 80), _f16_bytes(d), _f16_bytes(1.5 * d)], axis=1)
    else:
        raise ValueError(f"no random blocks for {qtype}")
    return raw.reshape(rows, -1)


# --- a plain Q6_K quantizer ----------------------------------------------------------------------------------

def quantize_q6_k(weights: np.ndarray) -> np.ndarray:
    """float [rows, cols] -> Q6_K bytes [rows, cols / 256 * 210] as llama.cpp's quantize_row_q6_K_ref does it
    without its least-squares refinement: each 16's scale maps its largest-magnitude weight to -32, the block's
    largest scale to -128 (so neighbouring 16-scales differ as real files' do)."""
    rows = weights.shape[0]
    x = weights.astype(np.float32).reshape(-1, 16, 16)
    at = np.abs(x).argmax(axis=-1)[..., None]
    signed_max = np.take_along_axis(x, at, axis=-1)[..., 0]  # [n, 16]
    scales = signed_max / -32.0
    big = np.take_along_axis(scales, np.abs(scales).argmax(axis=-1)[:, None], axis=-1)[:, 0]
    with np.errstate(divide="ignore", invalid="ignore"):
        d = np.where(big != 0, big / -128.0, 0.0).astype(np.float16)
        sc = np.where(big[:, None] != 0, np.minimum(127, np.rint(scales / d.astype(np.float32)[:, None])), 0)
        step = d.astype(np.float32)[:, None] * sc
        q = np.where(step[..., None] != 0, np.rint(x / step[..., None]), 0)
    q = (np.clip(q, -32, 31) + 32).reshape(-1, QK_K)
    return pack_q6_k(d.astype(np.float32), sc.astype(np.int8), q).reshape(rows, -1)
