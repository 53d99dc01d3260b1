"""What the router reads of an OpenAI request body: whether it streams, its prompt's leading text, and how many
sequences it runs (`n`: each choice holds a running slot on its replica)."""
from __future__ import annotations

import json
from dataclasses import dataclass

MAX_SEQUENCES = 128  # the daemon's bound on n: past it the replica refuses the request anyway


@dataclass(frozen=True)
class RequestInfo:
    stream: bool
    prompt_text: str  # what prefix affinity hashes ("" when there is no text prompt)
    prompt_tokens: int  # estimated (the router never tokenizes)
    sequences: int = 1  # `n`: the running slots it takes on its replica (a malformed n: 1, the replica refuses it)


def _message_text(messages: list) -> str:
    parts = []
    for message in messages:
        if not isinstance(message, dict):
            continue
        content = message.get("content")
        if isinstance(content, str):
            parts.append(content)
        elif isinstance(content, list):  # content parts: only the text ones count
            parts.extend(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
        parts.append("\n")
    return "".join(parts)


def read_request(body: bytes, chars_per_token: float) -> RequestInfo:
    """Never raises: a body it cannot read is forwarded anyway (the replica gives the proper 4xx)."""
    try:
        data = json.loads(body) if body else {}
    except (ValueError, UnicodeDecodeError, RecursionError):
        return RequestInfo(False, "", 0)
    return read_parsed(data, chars_per_token)


def read_parsed(data: object, chars_per_token: float) -> RequestInfo:
    """As read_request, from the body the door guard already parsed (http_doors.body_guard.PARSED_BODY)."""
    if not isinstance(data, dict):
        return RequestInfo(False, "", 0)
    stream = data.get("stream") is True
    n = data.get("n")
    sequences = n if isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= MAX_SEQUENCES else 1
    prompt = data.get("prompt")
    messages = data.get("messages")
    if isinstance(prompt, str):
        text = prompt
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return RequestInfo(stream, ",".join(map(str, prompt[:4096])), len(prompt), sequences)
    elif isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        text = prompt[0]
    elif isinstance(messages, list):
        text = _message_text(messages)
    else:
        text = ""
    return RequestInfo(stream, text, round(len(text) / chars_per_token), sequences)
