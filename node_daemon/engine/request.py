"""One request's state as the scheduler and the engine see it."""
from __future__ import annotations

import enum
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable

from stallfree.node_daemon.engine.block_pool import ROOT_HASH, BlockHash, hash_block_tokens
from stallfree.node_daemon.engine.sampling_params import SamplingParams
from stallfree.node_daemon.engine.speculation import DraftState

if TYPE_CHECKING:  # structured/ loads torch and llguidance; the scheduler and the sim backend never need to
    from stallfree.node_daemon.structured.matcher import Matcher


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # lost its KV, waits to be recomputed (ahead of new requests)
    FINISHED_STOPPED = "stop"  # EOS, stop token or stop string
    FINISHED_LENGTH = "length"  # max_tokens or the model's context
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"  # failed alone (preparing, sampling or detokenizing it raised)
    # Its grammar allowed no token (or refused the sampled one): structured/matcher.FINISH_GRAMMAR_DEAD_END.
    FINISHED_GRAMMAR_DEAD_END = "grammar_dead_end"

    @property
    def finished(self) -> bool:
        return self in _FINISHED


_FINISHED = {RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED,
             RequestStatus.FINISHED_ERROR, RequestStatus.FINISHED_GRAMMAR_DEAD_END}


@dataclass(frozen=True, slots=True)
class Objective:
    """What a request was sent to meet, as the router signed it (common/request_objective_header.py): the scheduler
    orders by priority (higher first) then deadline (earlier first), and the budget follows the TPOT target."""

    name: str
    priority: int = 0
    deadline: float | None = None  # first token by then, in the engine's clock (as arrival_time); None: none
    tpot_target_ms: float | None = None


# The urgency of a request without an objective: priority 0, no deadline (so first come, first served among them).
NO_URGENCY = (0, math.inf)


class Request:
    """Token ids, progress and KV blocks of one request.

    `token_ids` is the one token list: the prompt, then every generated token as it arrives (only
    append_output_token adds one; prompt_token_ids and output_token_ids are copies). Once the
    KV cache manager turns hashing on (prefix caching), `block_hashes` holds the chained content hash
    of every full block of `token_ids`, extended as tokens arrive, so a lookup never rehashes.
    `num_computed_tokens` counts tokens whose KV is in the cache. A request decodes once only its newest
    token lacks KV; before that it is (partially) prefilling. Preemption by recompute resets
    num_computed_tokens to 0, so the prompt and the outputs so far are prefilled again.
    """

    __slots__ = (
        "request_id", "token_ids", "num_prompt_tokens", "block_hashes", "hash_block_size", "sampling",
        "eos_token_ids", "status", "num_computed_tokens", "num_cached_tokens", "block_ids", "arrival_time",
        "first_scheduled_time", "first_token_time", "last_token_time", "finished_time", "num_preemptions",
        "max_model_len", "matcher", "objective", "arrival_seq", "draft_state", "prefix_cache", "paused",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Iterable[int],
        sampling: SamplingParams,
        eos_token_ids: tuple[int, ...] = (),
        arrival_time: float | None = None,
        max_model_len: int = 1 << 30,
        matcher: Matcher | None = None,
        objective: Objective | None = None,
        prefix_cache: bool = True,
    ) -> None:
        self.request_id = request_id
        self.prefix_cache = prefix_cache  # False: reads and fills no prefix cache (the profiler's random prompts)
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.block_hashes: list[BlockHash] = []
        self.hash_block_size = 0  # 0: no hashing (no prefix caching)
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
        # The grammar state of a constrained request (response_format, a forced tool call), None for free text:
        # the executor masks its logits and advances it by each sampled token.
        self.matcher = matcher
        self.objective = objective
        self.arrival_seq = 0  # its place in arrival order at the scheduler (set there): ties of urgency go by it
        # Its n-gram drafting (speculation.py), made by the scheduler at its first decode when speculation is on and
        # the request can be drafted for; False once found unable to (never asked again).
        self.draft_state: DraftState | None | bool = None
        # Its client is not reading its stream (async_engine.py): its decodes are skipped, its KV kept, until it
        # reads again or the server aborts it.
        self.paused = False

    @property
    def num_drafted_tokens(self) -> int:
        state = self.draft_state
        return state.num_drafted if state else 0

    @property
    def num_accepted_tokens(self) -> int:
        state = self.draft_state
        return state.num_accepted if state else 0

    @property
    def priority(self) -> int:
        return 0 if self.objective is None else self.objective.priority

    @property
    def urgency(self) -> tuple[int, float]:
        """Smaller is more urgent: a higher priority first, then an earlier deadline (none: after every deadline)."""
        objective = self.objective
        if objective is None:
            return NO_URGENCY
        return -objective.priority, math.inf if objective.deadline is None else objective.deadline

    # ---- tokens ------------------------------------------------------------------------------------

    def append_output_token(self, token: int) -> None:
        """Add a generated token; hash the block it fills, if it fills one."""
        tokens = self.token_ids
        tokens.append(token)
        size = self.hash_block_size
        if size and len(tokens) % size == 0:
            hashes = self.block_hashes
            hashes.append(hash_block_tokens(hashes[-1] if hashes else ROOT_HASH, tokens[-size:]))

    def hash_blocks(self, block_size: int) -> None:
        """Turn hashing on: the content hash of every full block so far (the prompt, on arrival)."""
        self.hash_block_size = block_size
        tokens, hashes = self.token_ids, self.block_hashes
        del hashes[:]
        parent = ROOT_HASH
        for start in range(0, len(tokens) - block_size + 1, block_size):
            parent = hash_block_tokens(parent, tokens[start:start + block_size])
            hashes.append(parent)

    @property
    def prompt_token_ids(self) -> tuple[int, ...]:
        """A copy of the prompt (hot paths index `token_ids` instead)."""
        return tuple(self.token_ids[:self.num_prompt_tokens])

    @property
    def output_token_ids(self) -> tuple[int, ...]:
        """A copy of the generated tokens (hot paths count num_output_tokens; append_output_token adds one)."""
        return tuple(self.token_ids[self.num_prompt_tokens:])

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_tokens_to_compute(self) -> int:
        """Tokens that still need a forward pass before the next token can be sampled."""
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def max_total_tokens(self) -> int:
        """The final KV footprint's bound: prompt plus every token it may generate, capped by the context."""
        return min(self.num_prompt_tokens + self.sampling.max_tokens, self.max_model_len)

    @property
    def finished(self) -> bool:
        return self.status.finished

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.value}, prompt={self.num_prompt_tokens}, "
            f"out={self.num_output_tokens}, computed={self.num_computed_tokens})"
        )

