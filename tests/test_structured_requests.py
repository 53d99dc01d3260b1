"""server/structured_requests.py without a daemon: the plan of a request, its 400s, and the template's view of tools."""
from __future__ import annotations

import asyncio

import pytest

from stallfree.node_daemon.server.errors import APIError
from stallfree.node_daemon.server.structured_requests import StructuredOutputs, plan_chat, template_messages
from stallfree.node_daemon.text.tool_calls.formats import HERMES, MISTRAL

TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}]


def _structured(fmt=HERMES, specials=None, compiler=None) -> StructuredOutputs:
    return StructuredOutputs(fmt, None, (specials or {}).get, compiler)


def test_special_token_markers_keep_special_tokens_in_the_text() -> None:
    assert not _structured(HERMES).keeps_special_tokens
    assert not _structured(MISTRAL).keeps_special_tokens  # "[TOOL_CALLS]" spelled as text by this tokenizer
    assert _structured(MISTRAL, {"[TOOL_CALLS]": 5}).keeps_special_tokens


def test_the_plan_follows_tool_choice_and_names_the_field_at_fault() -> None:
    structured = _structured()
    plan = asyncio.run(plan_chat(structured, None, TOOLS, "auto", None))
    assert plan.tool_format is HERMES and plan.grammar is None and plan.template_tools == TOOLS
    plan = asyncio.run(plan_chat(structured, None, TOOLS, "none", None))
    assert plan.tool_format is None  # "none": the text is all content, never parsed for calls
    for tools, choice, fmt, param in (
            ([{"type": "function", "function": {"name": "a b"}}], None, None, "tools"),
            (TOOLS, {"type": "function", "function": {"name": "sub"}}, None, "tool_choice"),
            (None, None, {"type": "json_schema", "json_schema": {"schema": {"not": {}}}}, "response_format"),
            (TOOLS, "required", None, "tools")):  # needs a grammar: this daemon (no compiler) cannot
        with pytest.raises(APIError) as caught:
            asyncio.run(plan_chat(structured, fmt, tools, choice, None))
        assert caught.value.status == 400 and caught.value.param == param, caught.value.message


def test_a_template_without_tools_gets_them_and_earlier_calls_in_its_messages() -> None:
    calls = [{"id": "c1", "type": "function", "function": {"name": "add", "arguments": {"a": 1}}}]
    messages = [{"role": "user", "content": "add"}, {"role": "assistant", "content": "", "tool_calls": calls},
                {"role": "tool", "content": "1", "tool_call_id": "c1"}]
    plain = template_messages(messages, TOOLS, "{{ messages }}", HERMES)
    assert plain[0]["role"] == "system" and '"name": "add"' in plain[0]["content"]
    assert plain[2]["content"] == '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'
    assert "tool_calls" not in plain[2] and plain[3] == messages[2]
    aware = "{% for m in messages %}{{ m.tool_calls }}{% endfor %}{{ tools }}"
    assert template_messages(messages, TOOLS, aware, HERMES) == messages  # the template renders both itself


def test_finish_reasons_as_openai_spells_them() -> None:
    from stallfree.node_daemon.server import finish

    assert finish.api_reason("grammar_dead_end") == "stop" and finish.api_reason("length") == "length"
    assert finish.with_calls("stop", True) == "tool_calls" and finish.with_calls("length", True) == "length"
    assert finish.with_calls("stop", False) == "stop"
    assert finish.add_stop_reason({"finish_reason": "stop"}, "grammar_dead_end")["stop_reason"] == "grammar_dead_end"
    assert "stop_reason" not in finish.add_stop_reason({"finish_reason": "stop"}, "stop")
