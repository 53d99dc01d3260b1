"""A request's choices gathered for its one JSON body: each choice's text, logprobs and last output, and usage."""
from __future__ import annotations

import dataclasses

from stallfree.node_daemon.engine.engine_protocol import RequestOutput
from stallfree.node_daemon.server.generation import Generation


@dataclasses.dataclass
class ChoiceResult:
    text: str = ""
    logprobs: list = dataclasses.field(default_factory=list)
    last: RequestOutput | None = None


def usage_of(lasts: list[RequestOutput | None]) -> tuple[int, int, int]:
    """(prompt tokens counted once, completion tokens of all choices, cached prompt tokens of all choices)."""
    outs = [o for o in lasts if o is not None]
    prompt = outs[0].num_prompt_tokens if outs else 0
    return prompt, sum(o.num_output_tokens for o in outs), sum(o.num_cached_tokens for o in outs)


def with_speculation(usage: dict, lasts: list[RequestOutput | None]) -> dict:
    """The usage with an extension field `speculation` when drafts were verified for the request: draft tokens
    verified, accepted and rejected, over all choices (absent when none were, as without speculation)."""
    outs = [o for o in lasts if o is not None]
    drafted = sum(o.num_drafted_tokens for o in outs)
    if drafted:
        accepted = sum(o.num_accepted_tokens for o in outs)
        usage["speculation"] = {"draft_tokens": drafted, "accepted_tokens": accepted,
                                "rejected_tokens": drafted - accepted}
    return usage


async def collect(generation: Generation) -> list[ChoiceResult]:
    results = [ChoiceResult() for _ in range(generation.n)]
    parts: list[list[str]] = [[] for _ in range(generation.n)]
    async for index, out in generation.outputs():
        result = results[index]
        if out.text:
            parts[index].append(out.text)
        if out.logprobs:
            result.logprobs.extend(out.logprobs)
        result.last = out
    for result, texts in zip(results, parts):
        result.text = "".join(texts)
    return results
