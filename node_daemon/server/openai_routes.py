"""/v1/completions, /v1/chat/completions and /v1/models, as OpenAI serves them.

The path of one request: validate (model, unsupported fields, prompt and max_tokens against the context)
-> admit (drain, queue bounds) -> engine.generate -> SSE chunks or one JSON body. Per-token work is one
string template and one json.dumps of the new text.
"""
from __future__ import annotations

import asyncio
import json
from typing import AsyncIterator, Callable

from fastapi import APIRouter, Depends
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse

from stallfree.node_daemon.async_engine import EngineDeadError
from stallfree.node_daemon.engine_protocol import RequestOutput
from stallfree.node_daemon.server import protocol
from stallfree.node_daemon.server.app import Daemon, get_daemon
from stallfree.node_daemon.server.errors import APIError, sse_error
from stallfree.node_daemon.server.generation import Generation, admit

router = APIRouter()

# OpenAI's default for the legacy completions endpoint; chat defaults to the rest of the context.
DEFAULT_COMPLETION_MAX_TOKENS = 16
SSE_DONE = "data: [DONE]\n\n"


def require_api_key(request: Request) -> None:
    get_daemon(request).auth.check_api_key(request)


@router.get("/v1/models", dependencies=[Depends(require_api_key)])
async def list_models(request: Request) -> JSONResponse:
    daemon = get_daemon(request)
    return JSONResponse(protocol.model_list(daemon.served_model_name, daemon.created,
                                            daemon.require_engine().max_model_len))


@router.post("/v1/completions", dependencies=[Depends(require_api_key)])
async def create_completion(body: protocol.CompletionRequest, request: Request):
    daemon = get_daemon(request)
    _check_request(daemon, body)
    prompt = body.single_prompt()
    if isinstance(prompt, str):
        prompt_ids = _encode(daemon, prompt)
    else:
        prompt_ids = _check_token_ids(daemon, prompt)
    return await _serve(daemon, request, body, prompt_ids, chat=False)


@router.post("/v1/chat/completions", dependencies=[Depends(require_api_key)])
async def create_chat_completion(body: protocol.ChatCompletionRequest, request: Request):
    daemon = get_daemon(request)
    _check_request(daemon, body)
    try:
        text = daemon.require_engine().apply_chat_template(body.chat_messages(), add_generation_prompt=True)
    except ValueError as exc:
        raise APIError(400, f"cannot apply the chat template: {exc}", param="messages") from None
    return await _serve(daemon, request, body, _encode(daemon, text), chat=True)


# --- validation -----------------------------------------------------------------------------------


def _check_request(daemon: Daemon, body: protocol._SamplingFields) -> None:
    daemon.require_engine()
    if body.model != daemon.served_model_name:
        raise APIError(404, f"The model `{body.model}` does not exist; this server serves "
                       f"`{daemon.served_model_name}`.", param="model", code="model_not_found", reason="not_found")
    problem = body.unsupported()
    if problem is not None:
        param, message = problem
        raise APIError(400, message, param=param, code="unsupported_parameter")


def _encode(daemon: Daemon, text: str) -> list[int]:
    try:
        return daemon.require_engine().encode(text)
    except ValueError as exc:
        raise APIError(400, f"cannot tokenize the prompt: {exc}", param="prompt") from None


def _check_token_ids(daemon: Daemon, ids: list[int]) -> list[int]:
    vocab = daemon.vocab_size
    if vocab is not None:
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(400, f"prompt token id {bad} is outside the vocabulary [0, {vocab})", param="prompt")
    return list(ids)


def _max_tokens(daemon: Daemon, body: protocol._SamplingFields, num_prompt_tokens: int, chat: bool) -> int:
    max_tokens = _max_tokens_in_context(daemon, body, num_prompt_tokens, chat)
    capacity = daemon.kv_capacity_tokens
    # The engine reserves a request's final KV footprint; one that can never fit is refused here, not mid-stream.
    if capacity is not None and num_prompt_tokens + max_tokens - 1 > capacity:
        raise APIError(400, f"the request needs {num_prompt_tokens + max_tokens - 1} tokens of KV cache but this "
                       f"server's whole cache holds {capacity}: lower max_tokens or shorten the prompt",
                       param="max_tokens", code="context_length_exceeded")
    return max_tokens


def _max_tokens_in_context(daemon: Daemon, body: protocol._SamplingFields, num_prompt_tokens: int,
                           chat: bool) -> int:
    context = daemon.require_engine().max_model_len
    if num_prompt_tokens == 0:
        raise APIError(400, "the prompt is empty", param="messages" if chat else "prompt")
    room = context - num_prompt_tokens
    if room < 1:
        raise APIError(400, f"This model's maximum context length is {context} tokens, but the prompt has "
                       f"{num_prompt_tokens} tokens; no room is left for output. Shorten the prompt.",
                       param="messages" if chat else "prompt", code="context_length_exceeded")
    requested = body.requested_max_tokens()
    if requested is None:
        return room if chat else min(DEFAULT_COMPLETION_MAX_TOKENS, room)
    if requested > room:
        param = "max_completion_tokens" if chat and getattr(body, "max_completion_tokens", None) else "max_tokens"
        raise APIError(400, f"This model's maximum context length is {context} tokens. However, you requested "
                       f"{num_prompt_tokens + requested} tokens ({num_prompt_tokens} in the prompt, {requested} "
                       f"for the completion). Reduce {param} to at most {room}.",
                       param=param, code="context_length_exceeded")
    return requested


# --- generation -----------------------------------------------------------------------------------


async def _serve(daemon: Daemon, request: Request, body: protocol._SamplingFields, prompt_ids: list[int],
                 chat: bool):
    sampling = body.to_sampling_params(_max_tokens(daemon, body, len(prompt_ids), chat))
    try:
        sampling.check()
    except ValueError as exc:
        raise APIError(400, str(exc)) from None
    rid = protocol.new_id("chatcmpl" if chat else "cmpl")
    ticket = admit(daemon, len(prompt_ids))
    generation = Generation(daemon, rid, prompt_ids, sampling, ticket)
    if body.stream:
        render = _ChunkRenderer(rid, protocol.now_s(), daemon.served_model_name, chat, body.include_usage)
        return _SSEResponse(_stream(daemon, generation, render), on_close=generation.close)
    return await _complete(daemon, request, generation, chat)


async def _complete(daemon: Daemon, request: Request, generation: Generation, chat: bool) -> JSONResponse:
    collect = asyncio.ensure_future(_collect(generation))
    gone = asyncio.ensure_future(_client_gone(request))
    try:
        await asyncio.wait((collect, gone), return_when=asyncio.FIRST_COMPLETED)
        if not collect.done():
            collect.cancel()
            # Nobody is listening; the abort (generation.close) frees the KV blocks.
            return JSONResponse({}, status_code=499)
        text, last = collect.result()
    finally:
        gone.cancel()
        generation.close()
    if last is None or last.finish_reason == "error":
        daemon.metrics.record_error("engine")
        detail = last.error if last is not None and last.error else "the engine stopped without an answer"
        raise APIError(500, f"generation failed: {detail}", code="engine_error", reason="engine")
    if last.finish_reason == "abort":
        raise APIError(503, "the request was aborted: the server is shutting down", code="aborted",
                       reason="draining", headers={"Retry-After": "1"})
    usage = protocol.usage(last.num_prompt_tokens, last.num_output_tokens, last.num_cached_tokens)
    build = protocol.chat_response if chat else protocol.completion_response
    return JSONResponse(build(generation.request_id, protocol.now_s(), daemon.served_model_name, text,
                              last.finish_reason, usage))


async def _collect(generation: Generation) -> tuple[str, RequestOutput | None]:
    parts: list[str] = []
    last = None
    try:
        async for out in generation.outputs():
            if out.text:
                parts.append(out.text)
            last = out
    except ValueError as exc:  # the engine refused the request at admission
        raise APIError(400, str(exc)) from None
    except EngineDeadError as exc:
        raise APIError(503, str(exc), code="engine_dead", reason="engine", headers={"Retry-After": "5"}) from None
    return "".join(parts), last


async def _client_gone(request: Request) -> None:
    """Returns when the client disconnects (the body is already read, so receive() only reports that)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


class _ChunkRenderer:
    """SSE events of one stream; the per-token event is a prebuilt template around json.dumps(text)."""

    def __init__(self, rid: str, created: int, model: str, chat: bool, include_usage: bool) -> None:
        self.rid, self.created, self.model, self.chat = rid, created, model, chat
        # With include_usage every chunk carries "usage": null and one last chunk carries the counts.
        self.include_usage = include_usage
        head = json.dumps({"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                           "created": created, "model": model}, separators=(",", ":"))[:-1]
        usage_field = ',"usage":null' if include_usage else ""
        if chat:
            self._text_head = 'data: ' + head + ',"choices":[{"index":0,"delta":{"content":'
            self._text_tail = '},"logprobs":null,"finish_reason":null}]' + usage_field + '}\n\n'
        else:
            self._text_head = 'data: ' + head + ',"choices":[{"index":0,"text":'
            self._text_tail = ',"logprobs":null,"finish_reason":null}]' + usage_field + '}\n\n'

    def text(self, text: str) -> str:
        return self._text_head + json.dumps(text, ensure_ascii=False) + self._text_tail

    def role(self) -> str:
        return _event(protocol.chat_chunk(self.rid, self.created, self.model, {"role": "assistant", "content": ""},
                                          None, self.include_usage))

    def finish(self, reason: str) -> str:
        if self.chat:
            chunk = protocol.chat_chunk(self.rid, self.created, self.model, {}, reason, self.include_usage)
        else:
            chunk = protocol.completion_chunk(self.rid, self.created, self.model, "", reason, self.include_usage)
        return _event(chunk)

    def usage(self, out: RequestOutput) -> str:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        usage = protocol.usage(out.num_prompt_tokens, out.num_output_tokens, out.num_cached_tokens)
        return _event(protocol.usage_chunk(self.rid, self.created, self.model, obj, usage))


def _event(data: dict) -> str:
    return "data: " + json.dumps(data, separators=(",", ":"), ensure_ascii=False) + "\n\n"


async def _stream(daemon: Daemon, generation: Generation, render: _ChunkRenderer) -> AsyncIterator[str]:
    if render.chat:
        yield render.role()
    last = None
    try:
        async for out in generation.outputs():
            last = out
            if out.text:
                yield render.text(out.text)
    except (ValueError, EngineDeadError) as exc:
        # The 200 and maybe some text went out already: the error becomes the stream's last event.
        daemon.metrics.record_error("invalid_request" if isinstance(exc, ValueError) else "engine")
        yield sse_error(str(exc), "invalid_request" if isinstance(exc, ValueError) else "engine_dead")
        yield SSE_DONE
        return
    if last is None or last.finish_reason == "error":
        daemon.metrics.record_error("engine")
        detail = last.error if last is not None and last.error else "the engine stopped without an answer"
        yield sse_error(f"generation failed: {detail}", "engine_error")
    elif last.finish_reason == "abort":
        daemon.metrics.record_error("draining")
        yield sse_error("the request was aborted: the server is shutting down", "aborted")
    else:
        yield render.finish(last.finish_reason)
        if render.include_usage:
            yield render.usage(last)
    yield SSE_DONE


class _SSEResponse(StreamingResponse):
    """A StreamingResponse that always runs `on_close`, even when the client left before the first byte."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()
