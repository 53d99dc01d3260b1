"""The sim execution backend: runs a scheduled iteration by letting the cost model's time pass.

Real-time mode sleeps for the predicted iteration time (`stallfree serve --backend sim`: the same
scheduler, API, metrics and admin endpoints, at a speed no CPU could compute); virtual-time mode only
advances a clock (`stallfree simulate`, VirtualReplica). Sampled tokens are deterministic placeholders:
bytes of a fixed text, so a byte-level tokenizer turns them into readable words, never EOS unless asked.

In real time the engine's own scheduling time comes on top of the sleep, so a served sim iteration is a
little slower than predicted (the cost model's overhead term already stands for that work on a device).
"""
from __future__ import annotations

import time
import zlib

from stallfree.node_daemon.engine.engine_protocol import ExecutorOutput
from stallfree.node_daemon.engine.scheduler_output import SchedulerOutput
from stallfree.node_daemon.sim.cost_model import IterationCostModel

PLACEHOLDER_TEXT = (
    b"The quick brown fox jumps over the lazy dog while the scheduler keeps every decode moving. "
    b"Chunked prefill splits long prompts so that no iteration stalls the running streams. "
)


class VirtualClock:
    """Simulated seconds; only the simulation moves it."""

    def __init__(self, start: float = 0.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class SimExecutor:
    """Executor protocol (engine_protocol.Executor) over a cost model."""

    # No model, no KV tensors: the engine's config sizes the cache and the context, the sim tokenizer its EOS.
    loaded = None
    num_blocks = None
    block_size = None
    max_model_len = None

    def __init__(
        self,
        cost_model: IterationCostModel,
        clock: VirtualClock | None = None,
        vocab_size: int = 256,
        eos_token_id: int | None = None,
        eos_after: int | None = None,
    ) -> None:
        """clock None: real time (sleep). eos_after N: every request's N-th output token is `eos_token_id`."""
        if eos_after is not None and (eos_token_id is None or eos_after < 1):
            raise ValueError("eos_after needs an eos_token_id and must be at least 1")
        self.cost_model = cost_model
        self.clock = clock
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.eos_after = eos_after
        self.last_iteration_ms = 0.0
        self.num_iterations = 0
        self.busy_s = 0.0
        self._offsets: dict[str, int] = {}  # request -> its placeholder text offset (crc32 once per request)

    def execute(self, output: SchedulerOutput) -> ExecutorOutput:
        decode_context_lens: list[int] = []
        prefill_chunks: list[tuple[int, int]] = []
        sampled: dict[str, int] = {}
        offsets, text, vocab = self._offsets, PLACEHOLDER_TEXT, self.vocab_size
        eos_after = self.eos_after
        for chunk in output.chunks:
            if chunk.is_prefill:
                prefill_chunks.append((chunk.start, chunk.num_tokens))
            else:
                decode_context_lens.append(chunk.start + chunk.num_tokens)
            if chunk.samples:
                request = chunk.request
                request_id = request.request_id
                position = request.num_output_tokens
                if eos_after is not None:
                    sampled[request_id] = self.placeholder_token(request_id, position)
                    continue
                offset = offsets.get(request_id)
                if offset is None:
                    offset = offsets[request_id] = _text_offset(request_id)
                sampled[request_id] = text[(offset + position) % len(text)] % vocab
        iteration_ms = self.cost_model.predict_ms(decode_context_lens, prefill_chunks)
        self.last_iteration_ms = iteration_ms
        self.num_iterations += 1
        self.busy_s += iteration_ms / 1000.0
        if self.clock is None:
            time.sleep(iteration_ms / 1000.0)
        else:
            self.clock.advance(iteration_ms / 1000.0)
        return ExecutorOutput(sampled)

    def free(self, request_id: str) -> None:
        """The engine is done with a request (finished or aborted)."""
        self._offsets.pop(request_id, None)

    def placeholder_token(self, request_id: str, position: int) -> int:
        """The token a request samples at output `position`: deterministic, and EOS only when asked."""
        if self.eos_after is not None and position + 1 >= self.eos_after:
            return self.eos_token_id  # type: ignore[return-value]
        return PLACEHOLDER_TEXT[(_text_offset(request_id) + position) % len(PLACEHOLDER_TEXT)] % self.vocab_size


def _text_offset(request_id: str) -> int:
    """Where in the placeholder text a request's output starts (so requests' texts differ)."""
    return zlib.crc32(request_id.encode()) % len(PLACEHOLDER_TEXT)
