"""How each model family writes tool calls, and how to tell which family a chat template belongs to.

- hermes (Hermes, Qwen 2.5/3): `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, one block per call.
- llama3_json (Llama 3.1-3.3): `{"name": ..., "parameters": {...}}`, calls separated by `;`, sometimes
  after `<|python_tag|>`.
- mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`.
Markers that are special tokens (`[TOOL_CALLS]`, `<|python_tag|>`) reach the parser only when the detokenizer
keeps special tokens; a family with `bare_start` also recognises its calls by their first character alone.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ToolCallFormat:
    name: str
    markers: tuple[str, ...]  # text that opens the calls (anywhere in the output)
    call_close: str = ""  # text that closes each call ("</tool_call>")
    bare_start: str = ""  # a first non-space character that opens the calls without a marker
    arguments_key: str = "arguments"  # the key the family writes the arguments under
    separator: str = ""  # written between parallel calls (the forced grammar's choice)
    array: bool = False  # the calls form one JSON array


HERMES = ToolCallFormat("hermes", markers=("<tool_call>",), call_close="</tool_call>", separator="\n")
LLAMA3_JSON = ToolCallFormat("llama3_json", markers=("<|python_tag|>",), bare_start="{", arguments_key="parameters",
                             separator="; ")
MISTRAL = ToolCallFormat("mistral", markers=("[TOOL_CALLS]",), bare_start="[", array=True)

FORMATS: dict[str, ToolCallFormat] = {f.name: f for f in (HERMES, LLAMA3_JSON, MISTRAL)}
ALIASES = {"qwen": "hermes", "qwen2": "hermes", "qwen3": "hermes", "llama3": "llama3_json", "llama": "llama3_json"}


def format_named(name: str) -> ToolCallFormat:
    """The format of a `--tool-call-parser` name (hermes, qwen, llama3_json, mistral)."""
    key = ALIASES.get(name.lower(), name.lower())
    if key not in FORMATS:
        raise ValueError(f"unknown tool-call parser {name!r}; known: {', '.join([*FORMATS, *ALIASES])}")
    return FORMATS[key]


def detect_format(chat_template: str | None) -> ToolCallFormat | None:
    """The family whose markers the chat template writes, or None when it shows no tool-call convention."""
    if not chat_template:
        return None
    if "<tool_call>" in chat_template:
        return HERMES
    if "[TOOL_CALLS]" in chat_template:
        return MISTRAL
    if "<|python_tag|>" in chat_template or ("<|start_header_id|>" in chat_template and "tools" in chat_template):
        return LLAMA3_JSON
    return None


def choose_format(parser_name: str | None, chat_template: str | None) -> ToolCallFormat:
    """An explicit name wins; then the template's markers; then hermes (ChatML-style models mostly follow it)."""
    if parser_name:
        return format_named(parser_name)
    return detect_format(chat_template) or HERMES
