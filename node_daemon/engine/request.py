"""One request's state as the scheduler and the engine see it."""
from __future__ import annotations

import enum
import time

from stallfree.node_daemon.engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # lost its KV, waits to be recomputed (ahead of new requests)
    FINISHED_STOPPED = "stop"  # EOS, stop token or stop string
    FINISHED_LENGTH = "length"  # max_tokens or the model's context
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"  # failed alone (preparing, sampling or detokenizing it raised)

    @property
    def finished(self) -> bool:
        return self in _FINISHED


_FINISHED = {RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED,
             RequestStatus.FINISHED_ERROR}


class Request:
    """Token ids, progress and KV blocks of one request.

    `num_computed_tokens` counts tokens whose KV is in the cache; `all_token_ids` is the prompt plus
    what was generated. A request decodes once only its newest token lacks KV; before that it is
    (partially) prefilling. Preemption by recompute resets num_computed_tokens to 0, so the prompt and
    the outputs so far are prefilled again.
    """

    __slots__ = (
        "request_id", "prompt_token_ids", "output_token_ids", "sampling", "eos_token_ids", "status",
        "num_computed_tokens", "num_cached_tokens", "block_ids", "arrival_time", "first_scheduled_time",
        "first_token_time", "last_token_time", "finished_time", "num_preemptions", "max_model_len",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        eos_token_ids: tuple[int, ...] = (),
        arrival_time: float | None = None,
        max_model_len: int = 1 << 30,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.sampling = sampling
        self.eos_token_ids = tuple(eos_token_ids)
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache at the last admission
        self.block_ids: list[int] = []
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.finished_time: float | None = None
        self.num_preemptions = 0
        self.max_model_len = max_model_len

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens_to_compute(self) -> int:
        """Tokens that still need a forward pass before the next token can be sampled."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_prefilling(self) -> bool:
        return self.num_tokens_to_compute > 1 or not self.output_token_ids

    @property
    def max_total_tokens(self) -> int:
        """The final KV footprint: prompt plus every token it may still generate, capped by the context."""
        return min(self.num_prompt_tokens + self.sampling.max_tokens, self.max_model_len)

    @property
    def finished(self) -> bool:
        return self.status.finished

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.value}, prompt={self.num_prompt_tokens}, "
            f"out={len(self.output_token_ids)}, computed={self.num_computed_tokens})"
        )
