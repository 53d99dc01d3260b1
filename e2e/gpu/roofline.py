"""Bytes and FLOPs of one engine iteration of a Llama-family model: the floors the GPU check compares against.

Decode is memory-bound: a step must read every weight once (the embedding table excepted: only the
batch's rows) plus every sequence's cached K and V, so its floor is
    (weight bytes + KV bytes) / measured copy bandwidth.
Prefill is compute-bound: 2 FLOPs per weight per token through the projections, plus attention's
QK^T and PV over the visible (causal) key positions, against the measured bf16 matrix rate.
Pure arithmetic on ModelShape figures; no torch.
"""
from __future__ import annotations

from dataclasses import dataclass

from stallfree.shapes import ModelShape


@dataclass(frozen=True)
class Sequence:
    """One sequence of an iteration: q_len new tokens over a cache that then holds seq_len tokens."""

    q_len: int
    seq_len: int

    @property
    def visible_pairs(self) -> int:
        """(query, key) pairs under the bottom-right causal mask: query j sees seq_len - q_len + j + 1 keys."""
        prefix = self.seq_len - self.q_len
        return self.q_len * prefix + self.q_len * (self.q_len + 1) // 2


def embedding_parameters(shape: ModelShape) -> int:
    return shape.vocab_size * shape.hidden_size


def lm_head_parameters(shape: ModelShape) -> int:
    return shape.vocab_size * shape.hidden_size


def weight_bytes_read(shape: ModelShape, num_tokens: int, dtype_bytes: int = 2) -> int:
    """Weights one forward reads: all but the embedding table, of which only num_tokens rows."""
    params = shape.num_parameters - embedding_parameters(shape) + num_tokens * shape.hidden_size
    if shape.tie_word_embeddings:  # the tied table is read whole as the LM head
        params += embedding_parameters(shape)
    return params * dtype_bytes


def kv_bytes_read(shape: ModelShape, batch: list[Sequence], dtype_bytes: int = 2) -> int:
    """Every layer reads each sequence's whole cached K and V once (the new tokens' writes are negligible)."""
    return sum(s.seq_len for s in batch) * shape.kv_bytes_per_token(dtype_bytes)


def decode_floor_s(shape: ModelShape, batch: list[Sequence], bandwidth_bytes_s: float, dtype_bytes: int = 2) -> float:
    num_tokens = sum(s.q_len for s in batch)
    total = weight_bytes_read(shape, num_tokens, dtype_bytes) + kv_bytes_read(shape, batch, dtype_bytes)
    return total / bandwidth_bytes_s


def iteration_flops(shape: ModelShape, batch: list[Sequence], sampled_rows: int) -> int:
    """Projections and MLP for every token, the LM head for sampled rows only, and causal attention."""
    num_tokens = sum(s.q_len for s in batch)
    body = shape.num_parameters - embedding_parameters(shape) - shape.hidden_size  # final norm: no matmul
    if not shape.tie_word_embeddings:
        body -= lm_head_parameters(shape)
    linear = 2 * body * num_tokens + 2 * lm_head_parameters(shape) * sampled_rows
    pairs = sum(s.visible_pairs for s in batch)
    attention = 4 * shape.num_layers * shape.num_heads * shape.head_dim * pairs  # QK^T and PV, 2 FLOPs each
    return linear + attention


def attention_flops(shape: ModelShape, batch: list[Sequence], num_layers: int = 1) -> int:
    return 4 * num_layers * shape.num_heads * shape.head_dim * sum(s.visible_pairs for s in batch)


def attention_kv_bytes(shape: ModelShape, batch: list[Sequence], dtype_bytes: int = 2, num_layers: int = 1) -> int:
    """One layer's K and V reads (each sequence's cache once), the floor of a memory-bound attention call."""
    return sum(s.seq_len for s in batch) * 2 * shape.num_kv_heads * shape.head_dim * dtype_bytes * num_layers
