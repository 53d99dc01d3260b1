"""OpenAI's wire format for completions and chat completions: requests, responses, stream chunks, errors.

Requests are parsed here (pydantic, at the edge); the engine only sees plain SamplingParams, whose problem()
holds the sampling values' ranges. Unknown fields are ignored the way OpenAI-compatible servers do; fields we
understand but cannot honour (best_of, suffix, vLLM's guided_*, ...) are refused with a clear 400 by `unsupported()`
instead of being dropped, and values only the wire can judge by `invalid()` (400 invalid_request_error). Every
request model is strict: a JSON value of the wrong type is refused, never coerced (`"max_tokens": true` is not 1,
`"stream": "yes"` is not true); an int is still a valid float.
"""
from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

from stallfree.node_daemon.engine.sampling_params import MAX_STOP_STRINGS, SamplingParams
from stallfree.node_daemon.server import legacy_fields

# Request models: unknown fields ignored, known ones strictly typed.
STRICT = ConfigDict(extra="ignore", strict=True)


MAX_N = 128  # OpenAI's bound on choices per request
MAX_MESSAGES = 2048  # OpenAI's bound on a chat's messages
MAX_TOP_LOGPROBS = 20  # chat
MAX_COMPLETION_LOGPROBS = 5  # the legacy completions endpoint


def _token_id(key: str) -> int | None:
    """A logit_bias key as a token id ("50256" -> 50256), None if it is not a plain non-negative integer."""
    return int(key) if isinstance(key, str) and key.isdecimal() and key.isascii() and len(key) < 12 else None


# Lists a client may make long stop at their first bad item (one error, not one per item).
_FAIL_FAST = Field(fail_fast=True)
TokenIds = Annotated[list[int], _FAIL_FAST]


def _prompt_kind(value: Any) -> str:
    """Which member of the prompt union to validate, from the value's first item: pydantic's smart union tried
    every member on every item (0.7 s for 1.33 M token ids); this validates one."""
    if isinstance(value, list) and value:
        first = value[0]
        return "list[str]" if isinstance(first, str) else "list[list[int]]" if isinstance(first, list) else "list[int]"
    return "list[int]" if isinstance(value, list) else "str"


# A string, a batch of one string, token ids, or a batch of one token-id list. The tags read as pydantic's
# own union member names, so errors.py leaves them out of the error's param.
Prompt = Annotated[Union[Annotated[str, Tag("str")],
                         Annotated[list[str], _FAIL_FAST, Tag("list[str]")],
                         Annotated[TokenIds, Tag("list[int]")],
                         Annotated[list[TokenIds], _FAIL_FAST, Tag("list[list[int]]")]],
                   Discriminator(_prompt_kind)]

# Bounded as sent (empty strings, dropped later, count too); one member is validated, so the error names the bound.
StopStrings = Annotated[Union[Annotated[str, Tag("str")],
                              Annotated[list[str], Field(max_length=MAX_STOP_STRINGS), Tag("list")]],
                        Discriminator(lambda value: "list" if isinstance(value, list) else "str")]


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
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: StopStrings | None = None
    stop_token_ids: TokenIds | None = None
    include_stop_str_in_output: bool = False  # vLLM's extension
    seed: int | None = None
    ignore_eos: bool = False
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # vLLM's extension, like min_p
    min_p: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's constrained-output extensions: declared only so that they are refused (legacy_fields.py).
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None

    def unsupported(self) -> tuple[str, str] | None:
        """(param, message) for the first field we understand but cannot honour, else None."""
        problem = legacy_fields.refused_field({name: getattr(self, name, None) for name in legacy_fields.REFUSED})
        if problem is not None:
            return problem
        if self.stream_options is not None and not self.stream:
            return "stream_options", "stream_options is only allowed when stream is true"
        return None

    def invalid(self, vocab_size: int | None) -> tuple[str, str] | None:
        """(param, message) for the first value only the wire can judge, else None; the sampling values' ranges are
        SamplingParams.problem's (engine/request_rules.py applies them before admission)."""
        if not 1 <= self.n <= MAX_N:
            return "n", f"n must be between 1 and {MAX_N}, got {self.n}"
        for key in self.logit_bias or {}:
            token = _token_id(key)
            if token is None or (vocab_size is not None and token >= vocab_size):
                bound = f" in [0, {vocab_size})" if vocab_size is not None else ""
                return "logit_bias", f"logit_bias keys must be token ids{bound}, got {key!r}"
        return None

    def logprobs_wanted(self) -> int | None:
        """How many top logprobs per token (0: only the sampled token's), or None for no logprobs."""
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
            include_stop_str_in_output=self.include_stop_str_in_output,
            ignore_eos=self.ignore_eos,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            min_p=self.min_p or 0.0,
            logit_bias={int(k): v for k, v in self.logit_bias.items()} if self.logit_bias else None,
            logprobs=self.logprobs_wanted(),
        )


class CompletionRequest(SamplingFields):
    prompt: Prompt
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None
    response_format: dict[str, Any] | None = None

    def unsupported(self) -> tuple[str, str] | None:
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], (str, list)):
            if len(self.prompt) != 1:
                return "prompt", "a batch of prompts is not supported: send one prompt per request"
        if self.echo and self.logprobs is not None:
            return "logprobs", "logprobs of the prompt (echo with logprobs) are not supported"
        if self.best_of not in (None, 1):
            return "best_of", "best_of > 1 is not supported"
        if self.suffix:
            return "suffix", "suffix is not supported"
        return super().unsupported()

    def invalid(self, vocab_size: int | None) -> tuple[str, str] | None:
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_COMPLETION_LOGPROBS:
            return "logprobs", f"logprobs must be between 0 and {MAX_COMPLETION_LOGPROBS}, got {self.logprobs}"
        return super().invalid(vocab_size)

    def logprobs_wanted(self) -> int | None:
        return self.logprobs

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


class ToolCallFunction(BaseModel):
    model_config = STRICT
    name: str
    arguments: str | dict[str, Any] = ""  # a JSON string in OpenAI's API; an object is taken too


class MessageToolCall(BaseModel):
    model_config = STRICT
    id: str | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(BaseModel):
    model_config = STRICT
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool result: the call it answers

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], _FAIL_FAST] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    # OpenAI's deprecated function calling, served as tools/tool_choice (legacy_fields.py translates them).
    functions: Any = None
    function_call: Any = None

    def effective_tools(self) -> list[dict[str, Any]] | None:
        """`tools`, or the deprecated `functions` in tools' shape."""
        return self.tools if self.tools is not None else legacy_fields.tools_from_functions(self.functions)

    def effective_tool_choice(self) -> Any:
        """`tool_choice`, or the deprecated `function_call` in its shape."""
        if self.tool_choice is not None:
            return self.tool_choice
        return legacy_fields.tool_choice_from_function_call(self.function_call)

    def invalid(self, vocab_size: int | None) -> tuple[str, str] | None:
        if self.top_logprobs is not None:
            if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
                return "top_logprobs", f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {self.top_logprobs}"
            if not self.logprobs:
                return "top_logprobs", "top_logprobs needs logprobs set to true"
        return super().invalid(vocab_size)

    def logprobs_wanted(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def requested_max_tokens(self) -> int | None:
        # max_completion_tokens is the newer name; it wins when both are sent.
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def chat_messages(self) -> list[dict[str, Any]]:
        """The messages as chat templates take them: an assistant's calls with their arguments as objects, a tool
        result with the id of the call it answers."""
        out: list[dict[str, Any]] = []
        for m in self.messages:
            message: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
            if m.name is not None:
                message["name"] = m.name
            if m.tool_calls:
                message["tool_calls"] = [
                    {"id": c.id, "type": "function",
                     "function": {"name": c.function.name, "arguments": _arguments_object(c.function.arguments)}}
                    for c in m.tool_calls]
            if m.tool_call_id is not None:
                message["tool_call_id"] = m.tool_call_id
            out.append(message)
        return out


def _arguments_object(arguments: str | dict[str, Any]) -> Any:
    """A call's arguments (a JSON string in OpenAI's API) as the object chat templates render with tojson."""
    if isinstance(arguments, str):
        try:
            return json.loads(arguments) if arguments else {}
        except ValueError:
            return arguments
    return arguments


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


def completion_choice(index: int, text: str, finish_reason: str | None, logprobs: dict | None = None) -> dict:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def chat_choice(index: int, text: str | None, finish_reason: str | None, logprobs: dict | None = None,
                tool_calls: list[dict] | None = None) -> dict:
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}


def completion_response(rid: str, created: int, model: str, text: str, finish_reason: str | None,
                        usage_: dict[str, Any], logprobs: dict | None = None,
                        choices: list[dict] | None = None) -> dict[str, Any]:
    """One choice from text/finish_reason/logprobs, or `choices` (n > 1) built with completion_choice."""
    return {
        "id": rid, "object": "text_completion", "created": created, "model": model,
        "choices": choices if choices is not None else [completion_choice(0, text, finish_reason, logprobs)],
        "usage": usage_,
    }


def completion_chunk(rid: str, created: int, model: str, text: str, finish_reason: str | None,
                     with_usage_field: bool, index: int = 0, logprobs: dict | None = None) -> dict[str, Any]:
    chunk: dict[str, Any] = {
        "id": rid, "object": "text_completion", "created": created, "model": model,
        "choices": [completion_choice(index, text, finish_reason, logprobs)],
    }
    if with_usage_field:
        chunk["usage"] = None
    return chunk


def chat_response(rid: str, created: int, model: str, text: str, finish_reason: str | None,
                  usage_: dict[str, Any], logprobs: dict | None = None,
                  choices: list[dict] | None = None) -> dict[str, Any]:
    """One choice from text/finish_reason/logprobs, or `choices` (n > 1) built with chat_choice."""
    return {
        "id": rid, "object": "chat.completion", "created": created, "model": model,
        "choices": choices if choices is not None else [chat_choice(0, text, finish_reason, logprobs)],
        "usage": usage_,
    }


def chat_chunk(rid: str, created: int, model: str, delta: dict[str, Any], finish_reason: str | None,
               with_usage_field: bool, index: int = 0, logprobs: dict | None = None) -> dict[str, Any]:
    chunk: dict[str, Any] = {
        "id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
        "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}],
    }
    if with_usage_field:
        chunk["usage"] = None
    return chunk


# --- logprobs, as each endpoint spells them ---


def chat_logprobs(entries: list) -> dict[str, Any]:
    """choices[].logprobs of a chat completion (or of one stream chunk) from the engine's TokenLogprob entries."""
    return {"content": [{"token": e.token, "logprob": e.logprob, "bytes": list(e.token.encode()),
                         "top_logprobs": [{"token": text, "logprob": lp, "bytes": list(text.encode())}
                                          for _, text, lp in e.top]}
                        for e in entries],
            "refusal": None}


def completion_logprobs(entries: list, text_offset: int) -> dict[str, Any]:
    """choices[].logprobs of a legacy completion; `text_offset` is where the first token starts in the text.

    As vLLM: each top_logprobs dict holds the k most likely tokens and the sampled one.
    """
    offsets = []
    for e in entries:
        offsets.append(text_offset)
        text_offset += len(e.token)
    return {"tokens": [e.token for e in entries], "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{**{text: lp for _, text, lp in e.top}, e.token: e.logprob} for e in entries],
            "text_offset": offsets}


def usage_chunk(rid: str, created: int, model: str, obj: str, usage_: dict[str, Any]) -> dict[str, Any]:
    """The last chunk when stream_options.include_usage is set: no choices, only usage."""
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [], "usage": usage_}


def model_list(model: str, created: int, max_model_len: int) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [{"id": model, "object": "model", "created": created, "owned_by": "stallfree",
                  "max_model_len": max_model_len}],
    }
