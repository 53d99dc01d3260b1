"""Server-sent events of one streamed completion, exactly as OpenAI sends them.

Chat: a role chunk, content chunks, a chunk with finish_reason and an empty delta; completions: text
chunks, then one with finish_reason. With stream_options.include_usage every chunk carries "usage": null
and a last chunk with no choices carries the counts (with continuous_usage_stats, vLLM's extension, every
content chunk carries the running counts instead of null). Then `data: [DONE]`. The per-token event is a
prebuilt string template around one json.dumps of the new text (the hot path).
"""
from __future__ import annotations

import json
from typing import AsyncIterator, Callable

from starlette.responses import StreamingResponse

from stallfree.node_daemon.engine.async_engine import EngineDeadError
from stallfree.node_daemon.engine.engine_protocol import RequestOutput
from stallfree.node_daemon.server import protocol
from stallfree.node_daemon.server.app import Daemon
from stallfree.node_daemon.server.errors import sse_error
from stallfree.node_daemon.server.generation import Generation

SSE_DONE = "data: [DONE]\n\n"


class ChunkRenderer:
    """SSE events of one stream; the per-token event is a prebuilt template around json.dumps(text)."""

    def __init__(self, rid: str, created: int, model: str, chat: bool, include_usage: bool,
                 continuous_usage: bool = False) -> None:
        self.rid, self.created, self.model, self.chat = rid, created, model, chat
        # With include_usage every chunk carries "usage": null and one last chunk carries the counts.
        self.include_usage = include_usage
        self.continuous_usage = continuous_usage
        head = json.dumps({"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                           "created": created, "model": model}, separators=(",", ":"))[:-1]
        if chat:
            self._text_head = 'data: ' + head + ',"choices":[{"index":0,"delta":{"content":'
            self._text_tail = '},"logprobs":null,"finish_reason":null}]'
        else:
            self._text_head = 'data: ' + head + ',"choices":[{"index":0,"text":'
            self._text_tail = ',"logprobs":null,"finish_reason":null}]'
        self._text_end = (',"usage":null}\n\n' if include_usage else '}\n\n')

    def text(self, text: str, out: RequestOutput) -> str:
        if self.continuous_usage:
            p, c = out.num_prompt_tokens, out.num_output_tokens
            end = f',"usage":{{"prompt_tokens":{p},"completion_tokens":{c},"total_tokens":{p + c}}}}}\n\n'
        else:
            end = self._text_end
        return self._text_head + json.dumps(text, ensure_ascii=False) + self._text_tail + end

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


async def stream_events(daemon: Daemon, generation: Generation, render: ChunkRenderer) -> AsyncIterator[str]:
    if render.chat:
        yield render.role()
    last = None
    try:
        async for out in generation.outputs():
            last = out
            if out.text:
                yield render.text(out.text, out)
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


class SSEResponse(StreamingResponse):
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
