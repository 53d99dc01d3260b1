"""A request's structured-output plan: its grammar (response_format, a forced tool call), how its output is read
back (the family's tool-call parser) and the tools its chat template is given. Errors are 400s naming the field.

Built once per daemon (`StructuredOutputs.build`, at start-up): one GrammarCompiler bound to the served tokenizer,
the family's tool-call format (`--tool-call-parser`, else detected from the chat template), and whether that
format's markers are special tokens (then the text is detokenized with special tokens kept, so the parser sees
them). The sim backend computes no logits: it gets no compiler, and a request that needs a grammar is refused
before its schema is looked at.

A grammar is built, checked and compiled on grammar_work's threads within one deadline, before the request is
admitted: checking a large schema takes seconds, and the event loop serves every other stream meanwhile.
"""
from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from stallfree.node_daemon.server.errors import APIError
from stallfree.node_daemon.structured.compiler import CompiledGrammar, GrammarCompiler
from stallfree.node_daemon.structured.grammar import Grammar, compile_response_format
from stallfree.node_daemon.structured.grammar_work import GrammarBusy, GrammarWork, grammar_work
from stallfree.node_daemon.structured.request_grammar import request_grammar, special_token_lookup
from stallfree.node_daemon.text.tokenizer import Tokenizer
from stallfree.node_daemon.text.tool_calls.formats import ToolCallFormat, choose_format
from stallfree.node_daemon.text.tool_calls.tools import ToolChoice, parse_tool_choice, parse_tools


@dataclass(frozen=True)
class StructuredOutputs:
    """What the server needs to serve response_format and tools for the loaded model."""

    format: ToolCallFormat
    chat_template: str | None
    special_id: Callable[[str], int | None]
    compiler: GrammarCompiler | None = None  # None: the backend cannot constrain its output (sim)
    work: GrammarWork = grammar_work

    @classmethod
    def build(cls, tokenizer: Tokenizer, vocab_size: int | None, parser_name: str | None,
              constrained: bool) -> "StructuredOutputs":
        """`constrained`: the backend masks logits. The library's view of the vocabulary (about a second on a
        262k vocabulary, holding the GIL) is built by the first structured request, or before it by the engine
        once quiet (daemon.start_engine: AsyncEngine.when_quiet), never at ready, where it delayed the first
        answer, nor in a burst of requests, where it stalled every stream."""
        compiler = GrammarCompiler(tokenizer, vocab_size=vocab_size) if constrained else None
        return cls(choose_format(parser_name, tokenizer.chat_template), tokenizer.chat_template,
                   special_token_lookup(tokenizer), compiler)

    @property
    def keeps_special_tokens(self) -> bool:
        """The family's call markers are special tokens: the parser only sees them when the text keeps them."""
        fmt = self.format
        return any(self.special_id(m) is not None for m in (*fmt.markers, fmt.call_close) if m)


@dataclass
class OutputPlan:
    """One request's plan; the defaults decode free text as before."""

    grammar: CompiledGrammar | None = None
    tool_format: ToolCallFormat | None = None  # read tool calls out of the text (tool_choice is not "none")
    template_tools: list[dict[str, Any]] | None = None  # the tools as the chat template takes them
    keep_special_tokens: bool = False
    choice: ToolChoice | None = field(default=None, repr=False)


async def plan_chat(structured: StructuredOutputs, response_format: Mapping[str, Any] | None,
                    tools: Sequence[Mapping[str, Any]] | None, tool_choice: Any,
                    parallel_tool_calls: bool | None) -> OutputPlan:
    """The chat request's plan; APIError 400 naming the parameter at fault."""
    with _param("tools"):
        parsed = parse_tools(tools)
    with _param("parallel_tool_calls" if not isinstance(parallel_tool_calls, (bool, type(None))) else "tool_choice"):
        choice = parse_tool_choice(parsed, tool_choice, parallel_tool_calls)
    fmt = structured.format
    param = "tools" if choice.forces_call else "response_format"
    plan = OutputPlan(choice=choice, template_tools=[dict(t) for t in tools] if parsed else None)
    if choice.mode != "none":
        plan.tool_format = fmt
        plan.keep_special_tokens = structured.keeps_special_tokens
    if choice.forces_call or _constrains(response_format):
        plan.grammar = await _compiled(structured, param, request_grammar, response_format, choice, fmt,
                                       structured.special_id)
    return plan


async def plan_completion(structured: StructuredOutputs, response_format: Mapping[str, Any] | None) -> OutputPlan:
    if not _constrains(response_format):
        with _param("response_format"):
            compile_response_format(response_format)  # text, or a malformed value: its 400 (cheap either way)
        return OutputPlan()
    return OutputPlan(grammar=await _compiled(structured, "response_format", compile_response_format,
                                              response_format))


def _constrains(response_format: Any) -> bool:
    """The response_format asks for a grammar (anything but absent or text; malformed ones are refused inside)."""
    return response_format is not None and not (isinstance(response_format, Mapping)
                                                and response_format.get("type") == "text")


async def _compiled(structured: StructuredOutputs, param: str, build: Callable[..., Grammar | None],
                    *args) -> CompiledGrammar | None:
    """build(*args) and its compilation on the grammar workers, within their deadline; APIError 400 naming
    `param` when the grammar is refused or too slow to check, 503 when the workers stayed busy."""
    compiler = structured.compiler
    if compiler is None:
        raise APIError(400, f"{param} needs constrained decoding, which this backend (the simulator: no logits) "
                       "does not do; serve a real model", param=param, code="unsupported_parameter")

    def build_and_compile() -> CompiledGrammar | None:
        grammar = build(*args)
        return None if grammar is None else compiler.compile(grammar)

    if not compiler.has_vocabulary:  # built once per daemon (about a second): not this request's time
        await asyncio.to_thread(compiler.ll_tokenizer)
    with _param(param):
        try:
            return await structured.work.run(build_and_compile)
        except GrammarBusy as exc:
            raise APIError(503, f"server busy: {exc}; retry later", code="grammar_workers_busy",
                           reason="queue_full", headers={"Retry-After": "1"}) from None


class _param:
    """A ValueError inside becomes a 400 naming `param` (the message names the construct)."""

    def __init__(self, param: str) -> None:
        self.param = param

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, exc, tb) -> bool:
        if exc is not None and isinstance(exc, ValueError) and not isinstance(exc, APIError):
            raise APIError(400, f"{self.param}: {exc}", param=self.param, code="invalid_value") from None
        return False


# --- the chat template's view of tools, for templates that do not render them ------------------------------


def template_messages(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                      chat_template: str | None, fmt: ToolCallFormat) -> list[dict[str, Any]]:
    """Messages as the template should see them. A template that renders tools gets them as they are; one that
    does not (plain ChatML: SmolLM2) gets the tools described in the system message, and earlier calls written
    into the assistant's content in the family's format, so the model still sees both."""
    template = chat_template or ""
    out = [dict(m) for m in messages]
    if tools and "tools" not in template:
        described = _describe_tools(tools, fmt)
        if out and out[0]["role"] == "system":
            out[0]["content"] = (out[0]["content"] + "\n\n" + described).strip()
        else:
            out.insert(0, {"role": "system", "content": described})
    if "tool_calls" not in template:
        for message in out:
            calls = message.pop("tool_calls", None)
            if calls:
                written = "\n".join(_write_call(c, fmt) for c in calls)
                message["content"] = (message.get("content") or "") + written
    return out


def _describe_tools(tools: list[dict[str, Any]], fmt: ToolCallFormat) -> str:
    listing = "\n".join(json.dumps(t.get("function", t), ensure_ascii=False) for t in tools)
    example = _write_call({"function": {"name": "<function-name>", "arguments": {}}}, fmt)
    return (f"You may call these functions:\n{listing}\nTo call one, answer with:\n{example}")


def _write_call(call: Mapping[str, Any], fmt: ToolCallFormat) -> str:
    fn = call.get("function", {})
    body = json.dumps({"name": fn.get("name", ""), fmt.arguments_key: fn.get("arguments", {})}, ensure_ascii=False)
    if fmt.array:
        return f"{fmt.markers[0]}[{body}]"
    if fmt.call_close:
        return f"{fmt.markers[0]}\n{body}\n{fmt.call_close}"
    return body
