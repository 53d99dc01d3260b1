"""n > 1: one engine request per choice, the prompt's KV computed once.

Choice 0 starts alone; the others start when it reports its first token, i.e. once its whole prompt is in
the KV cache and its full blocks are in the prefix cache. Their prefills then hit those blocks and compute
only the prompt's last, partial block (a chunk of at most block_size tokens) instead of the whole prompt.
With prefix caching off they recompute the prompt. Seeded choices use seed + index (as vLLM), so two
seeded choices differ and each is reproducible.

The request is admitted once (one queue ticket, held by choice 0); usage counts the prompt once and the
completion tokens of every choice.
"""
from __future__ import annotations

import asyncio
import dataclasses
from typing import AsyncIterator

from stallfree.node_daemon.engine.async_engine import EngineDeadError
from stallfree.node_daemon.engine.engine_protocol import RequestOutput
from stallfree.node_daemon.engine.sampling_params import SamplingParams
from stallfree.node_daemon.server.app import Daemon
from stallfree.node_daemon.server.backpressure import QueueTicket
from stallfree.node_daemon.server.errors import sse_error
from stallfree.node_daemon.server.generation import Generation
from stallfree.node_daemon.server.streaming import SSE_DONE, ChunkRenderer

_SEED_MODULUS = 1 << 64


class Choices:
    def __init__(self, daemon: Daemon, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams,
                 n: int, ticket: QueueTicket, waited_s: float = 0.0) -> None:
        self.daemon = daemon
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.n = n
        self.samplings = [sampling if i == 0 or sampling.seed is None
                          else dataclasses.replace(sampling, seed=(sampling.seed + i) % _SEED_MODULUS)
                          for i in range(n)]
        self.waited_s = waited_s
        self.generations: list[Generation] = [Generation(daemon, f"{request_id}-0", prompt_token_ids,
                                                         self.samplings[0], ticket, waited_s)]

    def _start_siblings(self) -> None:
        for i in range(1, self.n):
            self.generations.append(Generation(self.daemon, f"{self.request_id}-{i}", self.prompt_token_ids,
                                               self.samplings[i], QueueTicket(0, queued=False), self.waited_s))

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(choice index, output) of every choice as they come, until all are finished; closes all on exit."""
        queue: asyncio.Queue = asyncio.Queue()
        done = object()

        async def pump(index: int, generation: Generation) -> None:
            try:
                async for out in generation.outputs():
                    queue.put_nowait((index, out))
            except BaseException as exc:  # noqa: BLE001 - handed to the consumer, which raises it
                queue.put_nowait((index, exc))
            finally:
                queue.put_nowait((index, done))

        tasks = [asyncio.ensure_future(pump(0, self.generations[0]))]
        remaining = 1
        started = self.n == 1
        try:
            while remaining:
                index, item = await queue.get()
                if index == 0 and not started:
                    started = True
                    if item is not done and not isinstance(item, BaseException):
                        self._start_siblings()
                        tasks += [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(self.generations) if i]
                        remaining += self.n - 1
                if item is done:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield index, item
        finally:
            for task in tasks:
                task.cancel()
            self.close()

    def close(self) -> None:
        for generation in self.generations:
            generation.close()


@dataclasses.dataclass
class ChoiceResult:
    text: str = ""
    logprobs: list = dataclasses.field(default_factory=list)
    last: RequestOutput | None = None


def usage_of(results: list[ChoiceResult]) -> tuple[int, int, int]:
    """(prompt tokens counted once, completion tokens of all choices, cached prompt tokens of all choices)."""
    lasts = [r.last for r in results if r.last is not None]
    prompt = lasts[0].num_prompt_tokens if lasts else 0
    return prompt, sum(o.num_output_tokens for o in lasts), sum(o.num_cached_tokens for o in lasts)


async def collect(choices: Choices) -> list[ChoiceResult]:
    results = [ChoiceResult() for _ in range(choices.n)]
    async for index, out in choices.outputs():
        result = results[index]
        if out.text:
            result.text += out.text
        if out.logprobs:
            result.logprobs.extend(out.logprobs)
        result.last = out
    return results


def failure(results: list[ChoiceResult]) -> RequestOutput | None:
    """The first choice that did not finish normally (error or abort), or None when all did."""
    for r in results:
        if r.last is None or r.last.finish_reason in ("error", "abort"):
            return r.last or RequestOutput("", [], "", True, "error", 0, 0, error="a choice ended without output")
    return None


async def stream_events(daemon: Daemon, choices: Choices, render: ChunkRenderer) -> AsyncIterator[str]:
    """The n > 1 stream: each event names its choice; a choice's finish chunk comes when it finishes."""
    for index in range(choices.n):
        if render.chat:
            yield render.role(index)
        elif render.echo is not None:
            yield render.echo_event(index)
    results = [ChoiceResult() for _ in range(choices.n)]
    try:
        async for index, out in choices.outputs():
            results[index].last = out
            if out.text:
                yield render.text(out.text, out, index)
            elif out.logprobs:
                render.hold(out, index)
            if out.finished and out.finish_reason in ("stop", "length"):
                yield render.finish(out.finish_reason, index)
    except (ValueError, EngineDeadError) as exc:
        kind = "invalid_request" if isinstance(exc, ValueError) else "engine"
        daemon.metrics.record_error(kind)
        yield sse_error(str(exc), "invalid_request" if kind == "invalid_request" else "engine_dead")
        yield SSE_DONE
        return
    bad = failure(results)
    if bad is not None and bad.finish_reason == "abort":
        daemon.metrics.record_error("draining")
        yield sse_error("the request was aborted: the server is shutting down", "aborted")
    elif bad is not None:
        daemon.metrics.record_error("engine")
        yield sse_error(f"generation failed: {bad.error or 'the engine stopped without an answer'}", "engine_error")
    elif render.include_usage:
        yield render.usage_counts(*usage_of(results))
    yield SSE_DONE
