"""/v1/completions, /v1/chat/completions, /v1/models and /v1/models/{id}, as OpenAI serves them.

The path of one request: validate (model, unsupported fields; then the request against the engine's limits, once:
engine/request_rules.py) -> admit (drain, queue bounds) -> engine.generate -> SSE chunks (streaming.py) or one
JSON body.
A prompt too long for the context by its length alone is refused before it is tokenized; large prompts
are templated and tokenized on the daemon's text workers, off the event loop.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses

from fastapi import APIRouter, Depends
from starlette.requests import Request
from starlette.responses import JSONResponse

from stallfree.http_doors.body_guard import RAW_BODY
from stallfree.node_daemon.engine.request_rules import InvalidRequest, check_prompt_tokens, check_request
from stallfree.node_daemon.server import choices, finish, outcome, protocol
from stallfree.node_daemon.server.app import Daemon, get_daemon
from stallfree.node_daemon.server.errors import APIError
from stallfree.node_daemon.server.generation import Generation, admit, router_wait
from stallfree.node_daemon.server.parsed_body import ParsedBodyRoute
from stallfree.node_daemon.server.router_objective import router_objective
from stallfree.node_daemon.server.streaming import ChunkRenderer, SSEResponse, stalled_streams, stream_events
from stallfree.node_daemon.server.structured_requests import (OutputPlan, StructuredOutputs, plan_chat,
                                                              plan_completion, template_messages)
from stallfree.node_daemon.text.tool_calls.formats import ToolCallFormat
from stallfree.node_daemon.text.tool_calls.parser import parse_tool_calls

# Each route validates the body the body guard parsed (off the event loop when large): parsed_body.py.
router = APIRouter(route_class=ParsedBodyRoute)

# OpenAI's default for the legacy completions endpoint; chat defaults to the rest of the context.
DEFAULT_COMPLETION_MAX_TOKENS = 16
# Texts longer than this are counted in pieces of this size before they are tokenized whole.
PIECE_CHARS = 1 << 16
# What one message adds to a chat's templating work, in characters (64 short messages leave the event loop).
TEMPLATE_CHARS_PER_MESSAGE = 128


def require_api_key(request: Request) -> None:
    get_daemon(request).auth.check_api_key(request)


@router.get("/v1/models", dependencies=[Depends(require_api_key)])
async def list_models(request: Request) -> JSONResponse:
    daemon = get_daemon(request)
    return JSONResponse(protocol.model_list(daemon.served_model_name, daemon.created,
                                            daemon.require_engine().max_model_len))


@router.get("/v1/models/{model_id:path}", dependencies=[Depends(require_api_key)])
async def retrieve_model(model_id: str, request: Request) -> JSONResponse:
    daemon = get_daemon(request)
    listing = protocol.model_list(daemon.served_model_name, daemon.created, daemon.require_engine().max_model_len)
    if model_id != daemon.served_model_name:
        raise _unknown_model(daemon, model_id)
    return JSONResponse(listing["data"][0])


@router.post("/v1/completions", dependencies=[Depends(require_api_key)])
async def create_completion(body: protocol.CompletionRequest, request: Request):
    daemon = get_daemon(request)
    _check_request(daemon, body)
    prompt = body.single_prompt()
    if isinstance(prompt, str):
        _check_text_length(daemon, len(prompt), "prompt")
        prompt_ids = await daemon.text_work(len(prompt), _encode, daemon, prompt)
    else:
        prompt_ids = _check_token_ids(daemon, prompt)
    echo = None
    if body.echo:  # the prompt's text leads the completion's text
        echo = prompt if isinstance(prompt, str) else daemon.require_engine().decode(prompt_ids)
    plan = OutputPlan()
    if body.response_format is not None:
        plan = await plan_completion(_structured(daemon, "response_format"), body.response_format)
    return await _serve(daemon, request, body, prompt_ids, chat=False, echo=echo,
                        ids_checked=not isinstance(prompt, str), plan=plan)


@router.post("/v1/chat/completions", dependencies=[Depends(require_api_key)])
async def create_chat_completion(body: protocol.ChatCompletionRequest, request: Request):
    daemon = get_daemon(request)
    _check_request(daemon, body)
    messages = body.chat_messages()
    tools, tool_choice = body.effective_tools(), body.effective_tool_choice()
    plan = OutputPlan()
    if tools is not None or tool_choice is not None or body.response_format is not None:
        structured = _structured(daemon, "tools" if tools is not None else "response_format")
        plan = await plan_chat(structured, body.response_format, tools, tool_choice, body.parallel_tool_calls)
        if plan.tool_format is not None or any(m.get("tool_calls") for m in messages):
            messages = template_messages(messages, plan.template_tools, structured.chat_template,
                                         structured.format)
    size = sum(len(m["content"]) for m in messages)
    _check_text_length(daemon, size, "messages")
    # The template costs per message too: a chat of many short messages is templated on a text worker as well.
    work = size + len(messages) * TEMPLATE_CHARS_PER_MESSAGE
    prompt_ids = await daemon.text_work(work, _template_and_encode, daemon, messages, plan.template_tools)
    return await _serve(daemon, request, body, prompt_ids, chat=True, plan=plan)


# --- validation -----------------------------------------------------------------------------------


def _unknown_model(daemon: Daemon, model: str) -> APIError:
    return APIError(404, f"The model `{model[:200]}` does not exist; this server serves "
                    f"`{daemon.served_model_name}`.", param="model", code="model_not_found", reason="not_found")


def _check_request(daemon: Daemon, body: protocol.SamplingFields) -> None:
    daemon.require_engine()
    if body.model != daemon.served_model_name:
        raise _unknown_model(daemon, body.model)
    problem = body.unsupported()
    if problem is not None:
        param, message = problem
        raise APIError(400, message, param=param, code="unsupported_parameter")
    problem = body.invalid(daemon.vocab_size)
    if problem is not None:
        param, message = problem
        raise APIError(400, message, param=param, code="invalid_value")


def _check_text_length(daemon: Daemon, num_chars: int, param: str) -> None:
    """Refuse, before tokenizing it, a text that has more tokens than the context by its length alone."""
    per_token = daemon.max_chars_per_token
    context = daemon.require_engine().max_model_len
    if per_token is not None and num_chars > per_token * (context - 1):
        raise APIError(400, f"This model's maximum context length is {context} tokens, but the prompt has "
                       f"{num_chars} characters: at least {-(-num_chars // per_token)} tokens. Shorten the prompt.",
                       param=param, code="context_length_exceeded")


def _encode(daemon: Daemon, text: str, param: str = "prompt") -> list[int]:
    """The prompt's token ids. A long text is first counted piece by piece, stopping once it is surely past the
    context: the ids of millions of tokens are never built (building and freeing them holds the GIL)."""
    engine = daemon.require_engine()
    try:
        if len(text) > PIECE_CHARS:
            context, counted = engine.max_model_len, 0
            for n, start in enumerate(range(0, len(text), PIECE_CHARS)):
                counted += len(engine.encode(text[start:start + PIECE_CHARS]))
                # Each piece may add a BOS and one token at its cut: never refuse a prompt that fits.
                if counted - 2 * (n + 1) >= context:
                    raise APIError(400, f"This model's maximum context length is {context} tokens, but the prompt "
                                   f"has more than {counted - 2 * (n + 1)} tokens. Shorten the prompt.",
                                   param=param, code="context_length_exceeded")
        return engine.encode(text)
    except (ValueError, TypeError) as exc:
        raise APIError(400, f"cannot tokenize the prompt: {exc}", param=param) from None


def _structured(daemon: Daemon, param: str) -> StructuredOutputs:
    structured = daemon.structured
    if structured is None:
        raise APIError(400, f"{param} is not available on this daemon", param=param, code="unsupported_parameter")
    return structured


def _template_and_encode(daemon: Daemon, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
    try:
        text = daemon.require_engine().apply_chat_template(messages, add_generation_prompt=True, tools=tools)
    except ValueError as exc:
        raise APIError(400, f"cannot apply the chat template: {exc}", param="messages") from None
    return _encode(daemon, text, "messages")


def _check_token_ids(daemon: Daemon, ids: list[int]) -> list[int]:
    """A prompt of token ids against the engine's limits (engine/request_rules.py), before it is admitted."""
    with _as_api_error():
        check_prompt_tokens(ids, daemon.require_limits())
    return list(ids)


def _max_tokens(daemon: Daemon, body: protocol.SamplingFields, num_prompt_tokens: int, chat: bool) -> int:
    """OpenAI's max_tokens: the endpoint's default when not given, and never past the context (the engine would
    accept more and stop at the context; OpenAI's API refuses it)."""
    context = daemon.require_engine().max_model_len
    room = context - num_prompt_tokens
    requested = body.requested_max_tokens()
    if requested is None or room < 1:  # no room: request_rules refuses the prompt
        return max(1, room if chat else min(DEFAULT_COMPLETION_MAX_TOKENS, room))
    if requested > room:
        param = "max_completion_tokens" if chat and getattr(body, "max_completion_tokens", None) else "max_tokens"
        raise APIError(400, f"This model's maximum context length is {context} tokens. However, you requested "
                       f"{num_prompt_tokens + requested} tokens ({num_prompt_tokens} in the prompt, {requested} "
                       f"for the completion). Reduce {param} to at most {room}.",
                       param=param, code="context_length_exceeded")
    return requested


@contextlib.contextmanager
def _as_api_error(prompt_param: str = "prompt"):
    """A request the rules refuse, as OpenAI's 400 naming the field (a chat's prompt is its messages)."""
    try:
        yield
    except InvalidRequest as exc:
        param = prompt_param if exc.param == "prompt" else exc.param
        raise APIError(400, exc.message, param=param, code=exc.code) from None


# --- generation -----------------------------------------------------------------------------------


async def _serve(daemon: Daemon, request: Request, body: protocol.SamplingFields, prompt_ids: list[int],
                 chat: bool, echo: str | None = None, ids_checked: bool = False, plan: OutputPlan | None = None):
    plan = plan or OutputPlan()
    sampling = body.to_sampling_params(_max_tokens(daemon, body, len(prompt_ids), chat))
    if plan.keep_special_tokens:  # the family's call markers are special tokens: the parser must see them
        sampling = dataclasses.replace(sampling, skip_special_tokens=False)
    # The one check of the request (engine/request_rules.py), before admission: the engine does not repeat it.
    limits = daemon.require_limits()
    with _as_api_error("messages" if chat else "prompt"):
        if not ids_checked:  # a tokenized text (token-id prompts were checked before their echo was decoded)
            check_prompt_tokens(prompt_ids, limits)
        check_request(len(prompt_ids), sampling, limits)
    rid = protocol.new_id("chatcmpl" if chat else "cmpl")
    ticket = admit(daemon, len(prompt_ids))
    # n > 1: one engine request per choice, the prompt's KV shared through the prefix cache (generation.py).
    waited_s = router_wait.seconds(request.headers, daemon.auth.admin_token)
    objective = router_objective.of(request.headers, daemon.auth.admin_token, request.scope.get(RAW_BODY, b""),
                                    request.scope.get("server"))
    generation = Generation(daemon, rid, prompt_ids, sampling, ticket, waited_s, n=body.n, grammar=plan.grammar,
                            objective=objective)
    if body.stream:
        render = ChunkRenderer(rid, protocol.now_s(), daemon.served_model_name, chat, body.include_usage,
                               body.continuous_usage, logprobs=sampling.logprobs is not None, echo=echo)
        return SSEResponse(stream_events(daemon, generation, render, plan.tool_format), on_close=generation.close,
                           on_stall=lambda: stalled_streams.on_stall(daemon))
    return await _complete(daemon, request, generation, chat, echo, plan.tool_format)


async def _unless_client_gone(request: Request, collecting):
    """What `collecting` returns, or None once the client has gone away first (collecting is then cancelled)."""
    collect = asyncio.ensure_future(collecting)
    gone = asyncio.ensure_future(_client_gone(request))
    try:
        await asyncio.wait((collect, gone), return_when=asyncio.FIRST_COMPLETED)
        if not collect.done():
            collect.cancel()
            return None
        return collect.result()
    finally:
        gone.cancel()


async def _complete(daemon: Daemon, request: Request, generation: Generation, chat: bool,
                    echo: str | None = None, tool_format: ToolCallFormat | None = None) -> JSONResponse:
    try:
        results = await _unless_client_gone(request, choices.collect(generation))
    except Exception as exc:  # noqa: BLE001 - mapped once (outcome.py); the APIError handler counts it
        raise outcome.of_exception(exc).api_error() from None
    finally:
        generation.close()  # an abort when unfinished: frees the KV blocks
    if results is None:
        return JSONResponse({}, status_code=499)  # nobody is listening
    lasts = [r.last for r in results]
    failure = outcome.of_choices(lasts)
    if failure is not None:
        raise failure.api_error()  # counted once, by the APIError handler
    wants_logprobs = generation.sampling.logprobs is not None
    rendered = []
    for i, r in enumerate(results):
        logprobs = _render_logprobs(r.logprobs, chat, echo) if wants_logprobs else None
        reason = finish.api_reason(r.last.finish_reason)
        if not chat:
            rendered.append(protocol.completion_choice(i, (echo or "") + r.text, reason, logprobs))
        elif tool_format is None:
            rendered.append(protocol.chat_choice(i, r.text, reason, logprobs))
        else:
            content, calls = parse_tool_calls(r.text, tool_format)
            rendered.append(protocol.chat_choice(i, content, finish.with_calls(reason, bool(calls)), logprobs,
                                                 tool_calls=calls))
        finish.add_stop_reason(rendered[-1], r.last.finish_reason)
    build = protocol.chat_response if chat else protocol.completion_response
    return JSONResponse(build(generation.request_id, protocol.now_s(), daemon.served_model_name, "", None,
                              choices.with_speculation(protocol.usage(*choices.usage_of(lasts)), lasts),
                              choices=rendered))


def _render_logprobs(entries: list, chat: bool, echo: str | None) -> dict:
    return protocol.chat_logprobs(entries) if chat else protocol.completion_logprobs(entries, len(echo or ""))


async def _client_gone(request: Request) -> None:
    """Returns when the client disconnects (the body is already read, so receive() only reports that)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
