"""What a request must meet to be served, stated once.

The server checks it before admission (each refusal a 400 naming the field); the engine checks it for callers that
reach it directly (the simulator, benchmarks, `stallfree generate`) and skips it for the server's, already checked.
The scheduler only asserts what these rules guarantee. The length rule, as vLLM's: the prompt must leave room for
one output token; a larger max_tokens is served until the context is full (finish_reason "length"), and the
request's final KV footprint must fit the whole cache.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from stallfree.node_daemon.engine.sampling_params import SamplingParams


class InvalidRequest(ValueError):
    """A request that can never be served: the client's message, the field at fault and OpenAI's error code."""

    def __init__(self, message: str, param: str | None = "prompt", code: str = "invalid_value") -> None:
        super().__init__(message)
        self.message, self.param, self.code = message, param, code


@dataclass(frozen=True)
class RequestLimits:
    """What one engine can serve: its context, vocabulary and KV cache."""

    max_model_len: int
    vocab_size: int | None
    num_kv_blocks: int
    block_size: int

    @property
    def kv_capacity_tokens(self) -> int:
        return self.num_kv_blocks * self.block_size


def check_prompt_tokens(token_ids: Sequence[int], limits: RequestLimits) -> None:
    """A prompt of token ids: not empty, within the context (checked first: a long list is not walked), and in the
    vocabulary (in C for plain ints; the per-token loop only names the bad one)."""
    if not token_ids:
        raise InvalidRequest("the prompt is empty: at least one token is needed")
    _check_length(len(token_ids), limits.max_model_len)
    vocab = limits.vocab_size
    if vocab is None:
        return
    if set(map(type, token_ids)) != {int} or min(token_ids) < 0 or max(token_ids) >= vocab:
        for token in token_ids:
            if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab:
                raise InvalidRequest(f"prompt token id {token!r} is outside the vocabulary [0, {vocab})")


def check_request(num_prompt_tokens: int, sampling: SamplingParams, limits: RequestLimits) -> None:
    """The whole request: its prompt's length against the context, its sampling parameters, its KV footprint."""
    if num_prompt_tokens == 0:
        raise InvalidRequest("the prompt is empty: at least one token is needed")
    _check_length(num_prompt_tokens, limits.max_model_len)
    problem = sampling.problem()
    if problem is not None:
        raise InvalidRequest(problem[1], param=problem[0])
    kv_tokens = kv_footprint(num_prompt_tokens, sampling.max_tokens, limits.max_model_len)
    if kv_tokens > limits.kv_capacity_tokens:
        raise InvalidRequest(f"the request needs {kv_tokens} tokens of KV cache but the whole cache holds "
                             f"{limits.num_kv_blocks} blocks of {limits.block_size} ({limits.kv_capacity_tokens} "
                             "tokens): lower max_tokens or shorten the prompt",
                             param="max_tokens", code="context_length_exceeded")


def kv_footprint(num_prompt_tokens: int, max_tokens: int, max_model_len: int) -> int:
    """Tokens of KV a request holds at its end (its last output token's KV is never written)."""
    return max(num_prompt_tokens, min(num_prompt_tokens + max_tokens, max_model_len) - 1)


def _check_length(num_prompt_tokens: int, max_model_len: int) -> None:
    if num_prompt_tokens >= max_model_len:
        raise InvalidRequest(
            f"This model's maximum context length is {max_model_len} tokens, but the prompt has {num_prompt_tokens} "
            f"tokens: it may have at most {max_model_len - 1}, to leave room for the output. Shorten the prompt.",
            code="context_length_exceeded")
