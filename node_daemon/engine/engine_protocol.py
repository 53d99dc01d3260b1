"""The seams around the engine: what the server calls, what the engine reports, what executes a step.

Three small protocols so the HTTP server, the metrics and the execution backend (a real model or the
cost-model simulation) can be built and replaced apart from the engine loop itself.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, AsyncIterator, Protocol

from stallfree.contracts import Ceilings, Tuning
from stallfree.node_daemon.engine.request import Objective, Request
from stallfree.node_daemon.engine.sampling_params import SamplingParams
from stallfree.node_daemon.engine.scheduler_output import SchedulerOutput

if TYPE_CHECKING:  # both load torch; the engine loop and the sim backend never need to
    from stallfree.node_daemon.engine.sampler import TokenLogprobs
    from stallfree.node_daemon.models.loader import LoadedModel
    from stallfree.node_daemon.structured.compiler import CompiledGrammar


@dataclass(slots=True)
class ExecutorOutput:
    """What one executed iteration sampled: a token for every chunk with `samples=True`, by request id, and the
    logprobs of the requests that asked for them (in the same answer, so they belong to the same iteration).
    `dead_ends`: constrained requests whose grammar allowed no token or refused the sampled one (no token)."""

    token_ids: dict[str, int]
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)
    dead_ends: set[str] = field(default_factory=set)
    # Verifications (a chunk with a draft): how many of the draft's tokens were kept before the sampled token, and
    # the logprobs of those kept tokens (the sampled token's are in `logprobs`).
    accepted: dict[str, int] = field(default_factory=dict)
    draft_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    # Constrained rows whose mask was not ready in time: no token this iteration, their newest token computed again.
    deferred: set[str] = field(default_factory=set)


class Executor(Protocol):
    """Runs scheduled iterations: on the model (model_executor.py) or in the cost model's time (sim/sim_executor.py).

    The sizes are what the executor fixed when it was built (the KV blocks it allocated, the model's context and
    vocabulary, the loaded model whose tokenizer and EOS ids the engine uses); None leaves each to the engine's
    config and tokenizer.
    """

    @property
    def loaded(self) -> LoadedModel | None: ...

    @property
    def num_blocks(self) -> int | None: ...

    @property
    def block_size(self) -> int | None: ...

    @property
    def max_model_len(self) -> int | None: ...

    @property
    def vocab_size(self) -> int | None: ...

    def execute(self, output: SchedulerOutput) -> ExecutorOutput: ...

    def free(self, request_id: str) -> None:
        """The engine is done with the request (finished or aborted): drop any state kept for it."""


@dataclass(slots=True)
class TokenLogprob:
    """One output token's logprob and the most likely alternatives, as text for the API (see sampling_params.py
    for which distribution). `token` is the token decoded alone (a partial UTF-8 character shows as U+FFFD)."""

    token_id: int
    token: str
    logprob: float
    top: list[tuple[int, str, float]]  # (token id, text, logprob), most likely first


@dataclass(slots=True)
class RequestOutput:
    """One update of one request, streamed from the engine to its caller."""

    request_id: str
    new_token_ids: list[int]
    text: str  # the new text since the last update (never a split UTF-8 character)
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | "error" | "grammar_dead_end" once finished
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int = 0
    error: str | None = None  # set with finish_reason "error" (e.g. the engine died mid-stream)
    logprobs: list[TokenLogprob] | None = None  # one per new token that is part of the text, when asked
    # Speculation so far: draft tokens verified, and of those accepted (rejected = drafted - accepted).
    num_drafted_tokens: int = 0
    num_accepted_tokens: int = 0


@dataclass(slots=True)
class IterationRecord:
    """What one engine iteration did; the metrics and the stats window are fed from these."""

    start: float  # time.monotonic() at the start of the step
    duration_s: float
    num_prefill_tokens: int
    num_decode_tokens: int
    token_budget: int
    max_num_seqs: int
    num_running: int
    num_waiting: int
    num_partial_prefills: int
    kv_usage: float
    num_preempted: int
    kv_reserved: float = 0.0  # share of KV blocks held or promised to running requests (scheduler.kv_reserved)
    num_evicted_blocks: int = 0  # cached KV blocks evicted during this iteration
    num_verify_tokens: int = 0  # draft tokens verified beside the decodes (in the budget, like prefill tokens)
    num_accepted_tokens: int = 0  # of those, accepted


class EngineObserver(Protocol):
    """Called from the engine loop (its own thread): keep every method cheap."""

    def on_iteration(self, record: IterationRecord) -> None: ...

    def on_token(self, request: Request, now: float, first: bool) -> None: ...

    def on_finished(self, request: Request, now: float) -> None: ...


class EngineClient(Protocol):
    """What the HTTP server needs from an engine running in the background."""

    model_name: str
    max_model_len: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: list[int]) -> str: ...

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None) -> str: ...

    def generate(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams, waited_s: float = 0.0,
                 checked: bool = False, grammar: CompiledGrammar | None = None,
                 objective: Objective | None = None) -> AsyncIterator[RequestOutput]: ...

    async def abort(self, request_id: str) -> None: ...

    def get_tuning(self) -> Tuning: ...

    def set_tuning(self, tuning: Tuning) -> None: ...  # raises contracts.TuningError

    @property
    def ceilings(self) -> Ceilings: ...
