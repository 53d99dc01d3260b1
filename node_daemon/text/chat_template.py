"""Chat templates: OpenAI-style messages -> one prompt string, rendered with jinja2 like Hugging Face does.

The template comes from the model (tokenizer_config.json, chat_template.jinja, or the GGUF's
tokenizer.chat_template); ChatML is the fallback. Rendering runs in jinja2's immutable sandbox, since a
template is code shipped with a checkpoint.
"""
from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_ROLES = frozenset({"system", "user", "assistant", "tool", "developer"})


class ChatTemplateError(ValueError):
    """The messages or the template cannot be rendered (the message says which and why)."""


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(f"chat template refused the messages: {message}")


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False, sort_keys: bool = False) -> str:
    # HF's tojson keeps non-ASCII text as is (jinja's own escapes it for HTML, which templates do not want).
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def _compile(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ChatTemplateError(f"chat template does not parse: {exc.message} (line {exc.lineno})") from None


def normalize_messages(messages: Any) -> list[dict[str, Any]]:
    """Check OpenAI-style messages; content given as a list of text parts is joined into one string."""
    if not isinstance(messages, list) or not messages:
        raise ChatTemplateError("messages must be a non-empty list")
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ChatTemplateError(f"messages[{i}] must be an object with 'role' and 'content'")
        role = message.get("role")
        if role not in _ROLES:
            raise ChatTemplateError(f"messages[{i}].role must be one of {sorted(_ROLES)}, got {role!r}")
        content = message.get("content")
        if content is None:
            content = ""
        elif isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ChatTemplateError(f"messages[{i}].content[{j}] must be a text part {{'type': 'text', 'text': ...}}")
                texts.append(part["text"])
            content = "".join(texts)
        elif not isinstance(content, str):
            raise ChatTemplateError(f"messages[{i}].content must be a string or a list of text parts")
        out.append({**message, "role": role, "content": content})
    return out


def render_chat(
    template: str | None,
    messages: Any,
    add_generation_prompt: bool = True,
    bos_token: str = "",
    eos_token: str = "",
    **extra: Any,
) -> str:
    """Render `messages` with `template` (ChatML when None). Raises ChatTemplateError on bad input."""
    compiled = _compile(template or CHATML_TEMPLATE)
    checked = normalize_messages(messages)
    try:
        return compiled.render(
            messages=checked, add_generation_prompt=add_generation_prompt, bos_token=bos_token,
            eos_token=eos_token, **extra,
        )
    except ChatTemplateError:
        raise
    except (jinja2.TemplateError, TypeError, KeyError, IndexError) as exc:
        raise ChatTemplateError(f"chat template failed to render: {exc}") from None
