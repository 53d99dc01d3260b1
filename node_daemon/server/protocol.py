"""OpenAI's wire format for completions and chat completions: requests, responses, stream chunks, errors.

Requests are validated here once (pydantic, at the edge); the engine only sees plain SamplingParams.
Unknown fields are ignored the way OpenAI-compatible servers do; fields we understand but cannot honour
(n > 1, logprobs, tools, ...) are refused with a clear 400 by `unsupported()` instead of being dropped.
Every request model is strict: a JSON value of the wrong type is refused, never coerced (`"max_tokens": true`
is not 1, `"stream": "yes"` is not true); an int is still a valid float.
"""
from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from stallfree.node_daemon.engine.sampling_params import SamplingParams

# Request models: unknown fields ignored, known ones strictly typed.
STRICT = ConfigDict(extra="ignore", strict=True)
# A seed is a 64-bit integer (signed or unsigned), what a torch.Generator takes.
MIN_SEED, MAX_SEED = -(1 << 63), (1 << 64) - 1


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: bool = False
    # vLLM's extension: every chunk carries the running usage (clients can count tokens per event).
    continuous_usage_stats: bool = False


class SamplingFields(BaseModel):
    """Fields both endpoints share; `top_k`, `ignore_eos`, `stop_token_ids` are the usual extensions."""

    model_config = STRICT

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    n: int = Field(default=1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = Field(default=None, ge=MIN_SEED, le=MAX_SEED)
    ignore_eos: bool = False
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    user: str | None = None

    def unsupported(self) -> tuple[str, str] | None:
        """(param, message) for the first field we understand but cannot honour, else None."""
        if self.n != 1:
            return "n", f"n={self.n} is not supported: this server returns exactly one choice (n=1)"
        if self.presence_penalty or self.frequency_penalty:
            param = "presence_penalty" if self.presence_penalty else "frequency_penalty"
            return param, f"{param} is not supported (leave it unset or 0)"
        if self.logit_bias:
            return "logit_bias", "logit_bias is not supported"
        if self.stream_options is not None and not self.stream:
            return "stream_options", "stream_options is only allowed when stream is true"
        return None

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        return [s for s in stops if s]

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and bool(self.stream_options and self.stream_options.continuous_usage_stats)

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def to_sampling_params(self, max_tokens: int) -> SamplingParams:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_k=self.top_k or 0,
            top_p=1.0 if self.top_p is None else self.top_p,
            seed=self.seed,
            stop=self.stop_strings,
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
        )


class CompletionRequest(SamplingFields):
    # A string, a batch of one string, token ids, or a batch of one token-id list.
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    def unsupported(self) -> tuple[str, str] | None:
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], (str, list)):
            if len(self.prompt) != 1:
                return "prompt", "a batch of prompts is not supported: send one prompt per request"
        if self.echo:
            return "echo", "echo is not supported"
        if self.logprobs is not None:
            return "logprobs", "logprobs are not supported"
        if self.best_of not in (None, 1):
            return "best_of", "best_of > 1 is not supported"
        if self.suffix:
            return "suffix", "suffix is not supported"
        return super().unsupported()

    def single_prompt(self) -> str | list[int]:
        """The one prompt, as text or token ids (call after unsupported() returned None)."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        return prompt  # type: ignore[return-value]


class TextContentPart(BaseModel):
    model_config = STRICT
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = STRICT
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None

    def unsupported(self) -> tuple[str, str] | None:
        if self.logprobs or self.top_logprobs:
            return "logprobs", "logprobs are not supported"
        if self.tools:
            return "tools", "tool calling is not supported"
        if self.tool_choice is not None:
            return "tool_choice", "tool_choice is only allowed when tools are given (and tools are not supported)"
        if self.response_format and self.response_format.get("type", "text") != "text":
            return "response_format", "only response_format {\"type\": \"text\"} is supported"
        return super().unsupported()

    def requested_max_tokens(self) -> int | None:
        # max_completion_tokens is the newer name; it wins when both are sent.
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def chat_messages(self) -> list[dict[str, str]]:
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in self.messages]


# --- responses (plain dicts on the hot path: building them through pydantic per token costs too much) ---


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    out: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached_tokens:
        out["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return out


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now_s() -> int:
    return int(time.time())


def completion_response(rid: str, created: int, model: str, text: str, finish_reason: str | None,
                        usage_: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": rid, "object": "text_completion", "created": created, "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}],
        "usage": usage_,
    }


def completion_chunk(rid: str, created: int, model: str, text: str, finish_reason: str | None,
                     with_usage_field: bool) -> dict[str, Any]:
    chunk: dict[str, Any] = {
        "id": rid, "object": "text_completion", "created": created, "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}],
    }
    if with_usage_field:
        chunk["usage"] = None
    return chunk


def chat_response(rid: str, created: int, model: str, text: str, finish_reason: str | None,
                  usage_: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": rid, "object": "chat.completion", "created": created, "model": model,
        "choices": [{
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": None,
            "finish_reason": finish_reason,
        }],
        "usage": usage_,
    }


def chat_chunk(rid: str, created: int, model: str, delta: dict[str, Any], finish_reason: str | None,
               with_usage_field: bool) -> dict[str, Any]:
    chunk: dict[str, Any] = {
        "id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}],
    }
    if with_usage_field:
        chunk["usage"] = None
    return chunk


def usage_chunk(rid: str, created: int, model: str, obj: str, usage_: dict[str, Any]) -> dict[str, Any]:
    """The last chunk when stream_options.include_usage is set: no choices, only usage."""
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [], "usage": usage_}


def model_list(model: str, created: int, max_model_len: int) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [{"id": model, "object": "model", "created": created, "owned_by": "stallfree",
                  "max_model_len": max_model_len}],
    }
