"""What one scheduling step hands to the model runner (or the sim backend)."""
from __future__ import annotations

from dataclasses import dataclass, field

from stallfree.node_daemon.engine.request import Request


@dataclass(slots=True)
class ScheduledChunk:
    """`num_tokens` tokens of `request`, starting at position `start` (= its num_computed_tokens before the step).

    Token ids are request.token_ids[start:start + num_tokens]; their KV goes to the slots given by
    request.block_ids. `samples` is True when the chunk reaches the request's newest token, so the
    runner must return a sampled token for it (a partial prefill chunk samples nothing).

    A verification (`draft` not empty) is a decode followed by its draft tokens: num_tokens = 1 + len(draft) rows,
    the request's newest token then the draft (which is not in request.token_ids), each row's logits returned.
    """

    request: Request
    start: int
    num_tokens: int
    is_prefill: bool
    samples: bool
    draft: list[int] | tuple[()] = ()  # a list once the scheduler gives it a draft


@dataclass(slots=True)
class SchedulerOutput:
    # Decodes first, then prefill chunks in the order they were scheduled.
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    num_decode_tokens: int = 0
    num_prefill_tokens: int = 0
    num_verify_tokens: int = 0  # draft tokens verified beside the decodes (speculation), in the budget too
    token_budget: int = 0

    @property
    def num_tokens(self) -> int:
        return self.num_decode_tokens + self.num_verify_tokens + self.num_prefill_tokens

    @property
    def is_empty(self) -> bool:
        return not self.chunks
