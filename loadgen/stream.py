"""One streaming request, measured from the client: TTFT, ITL, TPOT and end-to-end time.

Streaming /v1/completions or /v1/chat/completions with `max_tokens` and `ignore_eos`, so outputs have the asked
length. TTFT is send to first content chunk, ITL the gaps between content chunks, TPOT (end - first token) /
(output tokens - 1). The server's usage figures, when it sends them, are what is reported. A refusal (an HTTP
error status) keeps its status, error code and Retry-After, so a caller can tell a clean refusal from a loss.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import httpx


@dataclass
class RequestResult:
    index: int
    prompt_len: int  # what the workload asked for
    output_len: int
    scheduled_s: float  # arrival offset from the benchmark start
    sent_s: float | None = None
    ok: bool = False
    error: str | None = None
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None
    itl_ms: list[float] = field(default_factory=list)
    prompt_tokens: int | None = None  # the server's usage, when given
    output_tokens: int = 0
    slo_met: bool = False
    status: int | None = None  # the HTTP status of a refusal (None: answered 200, or no answer at all)
    refusal_code: str | None = None  # the refusal body's error.code, when it had one
    retry_after_s: float | None = None  # the refusal's Retry-After, when it had one


def streaming_body(endpoint: str, model: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "stream": True, "temperature": 0.0,
                            "ignore_eos": True, "stream_options": {"include_usage": True}}
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


class StreamError(Exception):
    """An OpenAI-style stream that answered with an HTTP error or carried an error event."""

    def __init__(self, message: str, status: int | None = None, code: str | None = None,
                 retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.retry_after_s = status, code, retry_after_s


def _refusal(status: int, text: str, retry_after: str | None) -> StreamError:
    """The StreamError of an HTTP error answer: its status, the OpenAI error body's code, its Retry-After."""
    code = None
    try:
        error = json.loads(text).get("error")
        code = error.get("code") if isinstance(error, dict) else None
    except (ValueError, AttributeError):
        pass
    try:
        retry = float(retry_after) if retry_after is not None else None
    except ValueError:
        retry = None
    return StreamError(f"HTTP {status}: {text[:300]}", status, code if isinstance(code, str) else None, retry)


async def stream_events(client: httpx.AsyncClient, url: str, body: dict[str, Any],
                        timeout: float | None | httpx.Timeout = httpx.USE_CLIENT_DEFAULT,
                        headers: dict[str, str] | None = None):
    """POST a streaming request and yield each JSON event up to [DONE]; StreamError for an HTTP or in-stream
    error (the message carries its first 300 characters)."""
    async with client.stream("POST", url, json=body, timeout=timeout, headers=headers) as response:
        if response.status_code != 200:
            text = (await response.aread()).decode(errors="replace")
            raise _refusal(response.status_code, text, response.headers.get("retry-after"))
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                return
            event = json.loads(data)
            if "error" in event:
                raise StreamError(f"stream error: {json.dumps(event['error'])[:300]}")
            yield event


async def send_request(client: httpx.AsyncClient, url: str, body: dict[str, Any], result: RequestResult,
                       endpoint: str, clock: Callable[[], float] = time.perf_counter,
                       headers: dict[str, str] | None = None) -> None:
    """Stream one request and fill `result` (errors are recorded, never raised); `headers` go with it."""
    start = clock()
    last = None
    chunks = 0
    try:
        async for event in stream_events(client, url, body, headers=headers):
            usage = event.get("usage")
            if usage:
                result.prompt_tokens = usage.get("prompt_tokens")
                result.output_tokens = usage.get("completion_tokens") or result.output_tokens
            for choice in event.get("choices") or []:
                text = choice.get("text") if endpoint == "completions" else (choice.get("delta") or {}).get("content")
                if not text:
                    continue
                now = clock()
                if last is None:
                    result.ttft_ms = (now - start) * 1000
                else:
                    result.itl_ms.append((now - last) * 1000)
                last = now
                chunks += 1
    except StreamError as exc:
        result.error = str(exc)
        result.status, result.refusal_code, result.retry_after_s = exc.status, exc.code, exc.retry_after_s
        return
    except (httpx.HTTPError, json.JSONDecodeError, OSError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        return
    end = clock()
    result.e2e_ms = (end - start) * 1000
    result.output_tokens = result.output_tokens or chunks
    if result.ttft_ms is None:
        result.error = "the stream ended without any output"
        return
    if result.output_tokens > 1:
        result.tpot_ms = (result.e2e_ms - result.ttft_ms) / (result.output_tokens - 1)
    result.ok = True
