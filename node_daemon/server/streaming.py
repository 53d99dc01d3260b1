"""Server-sent events of one streamed completion, exactly as OpenAI sends them.

Chat: a role chunk, content chunks, a chunk with finish_reason and an empty delta; completions: text
chunks, then one with finish_reason. With stream_options.include_usage every chunk carries "usage": null
and a last chunk with no choices carries the counts (with continuous_usage_stats, vLLM's extension, every
content chunk carries the running counts instead of null). Then `data: [DONE]`. The per-token event is a
prebuilt string template around one json.dumps of the new text (the hot path).

A client that stops reading: once the socket's buffers are full, each event's send waits for the client; the
engine would go on generating (n choices, thousands of tokens a second) into memory with its slots held. A send
that has waited STALL_ABORT_S is the end of the stream: the request is aborted (its KV blocks and engine slots
freed at the next iteration), the connection closed, and the abort counted as a timeout.
"""
from __future__ import annotations

import asyncio
import json
import logging
from typing import AsyncIterator, Callable

from starlette.responses import StreamingResponse

from stallfree.node_daemon.engine.engine_protocol import RequestOutput
from stallfree.node_daemon.server import finish, outcome, protocol
from stallfree.node_daemon.server.app import Daemon
from stallfree.node_daemon.server.choices import usage_of, with_speculation
from stallfree.node_daemon.server.generation import Generation
from stallfree.node_daemon.text.tool_calls.formats import ToolCallFormat
from stallfree.node_daemon.text.tool_calls.parser import ParsedDelta, ToolCallStreamParser

SSE_DONE = "data: [DONE]\n\n"
# How long one event may wait for a client that does not read before the request is aborted.
STALL_ABORT_S = 15.0

log = logging.getLogger(__name__)


class ChunkRenderer:
    """SSE events of one stream; the per-token event is a prebuilt template around json.dumps(text).

    With `logprobs` each text event carries the logprobs of the tokens it holds (tokens that produced no
    text yet, a split UTF-8 character, wait for the next event); `echo` is the prompt text a completion
    stream starts with. `index` names the choice when n > 1.
    """

    def __init__(self, rid: str, created: int, model: str, chat: bool, include_usage: bool,
                 continuous_usage: bool = False, logprobs: bool = False, echo: str | None = None) -> None:
        self.rid, self.created, self.model, self.chat = rid, created, model, chat
        # With include_usage every chunk carries "usage": null and one last chunk carries the counts.
        self.include_usage = include_usage
        self.continuous_usage = continuous_usage
        self.logprobs = logprobs
        self.echo = echo
        self._pending: dict[int, list] = {}  # choice index -> logprob entries not sent yet
        self._offsets: dict[int, int] = {}  # completions: text offset of the next token, per choice
        head = json.dumps({"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                           "created": created, "model": model}, separators=(",", ":"))[:-1]
        self._index_head = 'data: ' + head + ',"choices":[{"index":'
        self._content_head = ',"delta":{"content":' if chat else ',"text":'
        self._text_head = self._index_head + '0' + self._content_head
        self._logprobs_head = '},"logprobs":' if chat else ',"logprobs":'
        self._text_tail = self._logprobs_head + 'null,"finish_reason":null}]'
        self._text_end = (',"usage":null}\n\n' if include_usage else '}\n\n')

    def text(self, text: str, out: RequestOutput, index: int = 0) -> str:
        if self.continuous_usage:
            p, c = out.num_prompt_tokens, out.num_output_tokens
            end = f',"usage":{{"prompt_tokens":{p},"completion_tokens":{c},"total_tokens":{p + c}}}}}\n\n'
        else:
            end = self._text_end
        head = self._text_head if index == 0 else self._index_head + str(index) + self._content_head
        tail = self._text_tail
        if self.logprobs:
            self.hold(out, index)
            tail = (self._logprobs_head + json.dumps(self._take(index), separators=(",", ":"), ensure_ascii=False)
                    + ',"finish_reason":null}]')
        return head + json.dumps(text, ensure_ascii=False) + tail + end

    def hold(self, out: RequestOutput, index: int = 0) -> None:
        """Keep the logprobs of an output that brought no text, for the next event of that choice."""
        if out.logprobs:
            self._pending.setdefault(index, []).extend(out.logprobs)

    def _take(self, index: int) -> dict | None:
        entries = self._pending.pop(index, [])
        if self.chat:
            return protocol.chat_logprobs(entries)
        offset = self._offsets.get(index, len(self.echo or ""))
        rendered = protocol.completion_logprobs(entries, offset)
        self._offsets[index] = offset + sum(len(e.token) for e in entries)
        return rendered

    def role(self, index: int = 0) -> str:
        return _event(protocol.chat_chunk(self.rid, self.created, self.model, {"role": "assistant", "content": ""},
                                          None, self.include_usage, index=index))

    def echo_event(self, index: int = 0) -> str:
        """The first event of an echoing completion: the prompt's text."""
        return _event(protocol.completion_chunk(self.rid, self.created, self.model, self.echo or "", None,
                                                self.include_usage, index=index))

    def delta(self, parsed: ParsedDelta, out: RequestOutput, index: int = 0) -> str:
        """A chat event of parsed model text: content and/or tool-call deltas (tool_choice other than none)."""
        delta: dict = {}
        if parsed.content:
            delta["content"] = parsed.content
        if parsed.tool_calls:
            delta["tool_calls"] = parsed.tool_calls
        logprobs = None
        if self.logprobs:
            self.hold(out, index)
            logprobs = self._take(index)
        chunk = protocol.chat_chunk(self.rid, self.created, self.model, delta, None, self.include_usage,
                                    index=index, logprobs=logprobs)
        if self.continuous_usage:
            chunk["usage"] = protocol.usage(out.num_prompt_tokens, out.num_output_tokens)
        return _event(chunk)

    def finish(self, reason: str, index: int = 0, engine_reason: str | None = None) -> str:
        logprobs = self._take(index) if self.logprobs and self._pending.get(index) else None
        if self.chat:
            chunk = protocol.chat_chunk(self.rid, self.created, self.model, {}, reason, self.include_usage,
                                        index=index, logprobs=logprobs)
        else:
            chunk = protocol.completion_chunk(self.rid, self.created, self.model, "", reason, self.include_usage,
                                              index=index, logprobs=logprobs)
        finish.add_stop_reason(chunk["choices"][0], engine_reason)
        return _event(chunk)

    def usage_counts(self, lasts: list[RequestOutput | None]) -> str:
        """The last chunk's counts: as a non-streamed response's usage (speculation's extension field included)."""
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        usage = with_speculation(protocol.usage(*usage_of(lasts)), lasts)
        return _event(protocol.usage_chunk(self.rid, self.created, self.model, obj, usage))


def _joined(a: ParsedDelta, b: ParsedDelta) -> ParsedDelta:
    return ParsedDelta(a.content + b.content, a.tool_calls + b.tool_calls)


def _event(data: dict) -> str:
    return "data: " + json.dumps(data, separators=(",", ":"), ensure_ascii=False) + "\n\n"


async def stream_events(daemon: Daemon, generation: Generation, render: ChunkRenderer,
                        tool_format: ToolCallFormat | None = None) -> AsyncIterator[str]:
    """The request's stream, n choices included: each event names its choice; a choice's finish chunk comes when
    it finishes; a failure is the stream's last event (the 200 and maybe some text went out already). With a
    `tool_format` (chat, tool_choice not none) each choice's text goes through its own tool-call parser: content
    and tool_calls deltas, and "tool_calls" as the finish reason of a choice that made calls."""
    for index in range(generation.n):
        if render.chat:
            yield render.role(index)
        elif render.echo is not None:
            yield render.echo_event(index)
    lasts: list[RequestOutput | None] = [None] * generation.n
    parsers = [ToolCallStreamParser(tool_format) for _ in range(generation.n)] if tool_format else None
    try:
        async for index, out in generation.outputs():
            lasts[index] = out
            if parsers is not None:
                parsed = parsers[index].feed(out.text) if out.text else None
                if out.finished:
                    tail = parsers[index].finish()
                    parsed = _joined(parsed, tail) if parsed else tail
                if parsed:
                    yield render.delta(parsed, out, index)
                elif out.logprobs:
                    render.hold(out, index)
            elif out.text:
                yield render.text(out.text, out, index)
            elif out.logprobs:
                render.hold(out, index)
            if out.finished and out.finish_reason in finish.NORMAL:
                reason = finish.api_reason(out.finish_reason)
                if parsers is not None:
                    reason = finish.with_calls(reason, parsers[index].num_calls > 0)
                yield render.finish(reason, index, out.finish_reason)
    except Exception as exc:  # noqa: BLE001 - mapped (and logged when unexpected) by outcome.of_exception
        failure = outcome.of_exception(exc)
    else:
        failure = outcome.of_choices(lasts)
    if failure is not None:
        failure.count(daemon.metrics)
        yield failure.sse_event()
    elif render.include_usage:
        yield render.usage_counts(lasts)
    yield SSE_DONE


class StalledStreams:
    """Streams ended because their client stopped reading: counted as timeouts, logged the first time."""

    def __init__(self) -> None:
        self.count = 0

    def on_stall(self, daemon: Daemon) -> None:
        if not self.count:
            log.warning("a stream's client stopped reading for %g s: its request is aborted and its slots freed "
                        "(further ones are counted only, as stallfree_request_errors{reason=\"timeout\"})",
                        STALL_ABORT_S)
        self.count += 1
        daemon.metrics.record_error("timeout")


stalled_streams = StalledStreams()


class SSEResponse(StreamingResponse):
    """A StreamingResponse that always runs `on_close`, even when the client left before the first byte, and
    ends the stream (on_stall, then on_close) when one send has waited `stall_abort_s` for a client that does not
    read."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None],
                 on_stall: Callable[[], None] | None = None, stall_abort_s: float | None = None) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close
        self._on_stall = on_stall
        self.stall_abort_s = STALL_ABORT_S if stall_abort_s is None else stall_abort_s
        self.stalled = False
        self._send_started: float | None = None  # loop time the pending send began; None: not sending

    async def __call__(self, scope, receive, send) -> None:
        loop = asyncio.get_running_loop()

        async def timed_send(message) -> None:  # two stores per event: the hot path stays lean
            self._send_started = loop.time()
            await send(message)
            self._send_started = None

        task = asyncio.current_task()
        watchdog = loop.create_task(self._watch(loop, task))
        try:
            await super().__call__(scope, receive, timed_send)
        except asyncio.CancelledError:
            if not self.stalled:
                raise
            task.uncancel()  # our own cancellation: the connection is closed by the server
        finally:
            watchdog.cancel()
            if self.stalled and self._on_stall is not None:
                self._on_stall()
            self._on_close()

    async def _watch(self, loop: asyncio.AbstractEventLoop, task: asyncio.Task) -> None:
        """Cancel the response once a send has waited stall_abort_s; checks at a quarter of it."""
        period = self.stall_abort_s / 4
        while True:
            await asyncio.sleep(period)
            started = self._send_started
            if started is not None and loop.time() - started >= self.stall_abort_s:
                self.stalled = True
                task.cancel()
                return
