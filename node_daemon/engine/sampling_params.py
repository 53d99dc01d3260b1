"""Per-request sampling and stopping parameters (validated once at the API edge, plain afterwards).

The processing order, as vLLM's: logit_bias, then repetition_penalty (prompt and output tokens), then
frequency/presence penalties (output tokens), then temperature; then min_p, top-k and top-p restrict
the support. Logprobs are read from that processed distribution before the restriction (for greedy
rows at temperature 1), i.e. vLLM's "processed_logprobs" without truncation.
"""
from __future__ import annotations

from dataclasses import dataclass, field

# Below this a temperature is greedy: dividing logits by it would overflow float32 (as vLLM's _SAMPLING_EPS).
MIN_TEMPERATURE = 1e-5
MAX_TEMPERATURE = 2.0
MAX_LOGPROBS = 20
# A seed is a 64-bit integer (signed or unsigned), what a torch.Generator takes.
MIN_SEED, MAX_SEED = -(1 << 63), (1 << 64) - 1
# Stop strings: OpenAI allows 4; these bounds are generous and keep a request's matcher small (stop_matcher.py).
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256


@dataclass(frozen=True)
class SamplingParams:
    """Frozen: `plain_greedy` is computed once, so the sampler's common case costs one attribute read a row."""

    max_tokens: int = 16
    temperature: float = 1.0  # 0 (or below MIN_TEMPERATURE) means greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    min_p: float = 0.0  # 0 = off; keeps tokens with p >= min_p * p_max
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False  # vLLM's extension: the matched stop string ends the text
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # 1 = off
    logit_bias: dict[int, float] | None = None
    logprobs: int | None = None  # None: no logprobs; k >= 0: the sampled token's and the k most likely
    # False keeps special tokens in the text: a tool-call parser reads markers such as [TOOL_CALLS] there.
    skip_special_tokens: bool = True
    plain_greedy: bool = field(init=False, repr=False, compare=False)  # greedy, no bias, penalty or logprobs

    def __post_init__(self) -> None:
        object.__setattr__(self, "plain_greedy", self.greedy and not self.processes_logits and self.logprobs is None)

    def problem(self) -> tuple[str, str] | None:
        """(field, message) for the first value outside its range, else None (NaN is never in range). The one
        statement of the ranges (OpenAI's where it has one): the server's 400s and direct callers both use it."""
        if self.max_tokens < 1:
            return "max_tokens", f"max_tokens must be at least 1, got {self.max_tokens}"
        if self.seed is not None and not MIN_SEED <= self.seed <= MAX_SEED:
            return "seed", f"seed must be a 64-bit integer, got {self.seed}"  # what torch.Generator takes
        bounds = (("temperature", 0.0, MAX_TEMPERATURE), ("min_p", 0.0, 1.0), ("presence_penalty", -2.0, 2.0),
                  ("frequency_penalty", -2.0, 2.0))
        for name, low, high in bounds:
            if not low <= getattr(self, name) <= high:
                return name, f"{name} must be in [{low:g}, {high:g}], got {getattr(self, name)}"
        if self.top_k < 0:
            return "top_k", f"top_k must be >= 0, got {self.top_k}"
        if not 0.0 < self.top_p <= 1.0:
            return "top_p", f"top_p must be in (0, 1], got {self.top_p}"
        if not 0.0 < self.repetition_penalty <= 10.0:
            return "repetition_penalty", f"repetition_penalty must be in (0, 10], got {self.repetition_penalty}"
        if len(self.stop) > MAX_STOP_STRINGS:
            return "stop", f"stop may hold at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}"
        for text in self.stop:
            if len(text) > MAX_STOP_CHARS:
                return "stop", f"each stop string may have at most {MAX_STOP_CHARS} characters, got one of {len(text)}"
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            return "logprobs", f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}"
        for token, bias in (self.logit_bias or {}).items():
            if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                return "logit_bias", f"logit_bias keys must be token ids, got {token!r}"
            if not -100.0 <= bias <= 100.0:
                return "logit_bias", f"logit_bias values must be in [-100, 100], got {bias} for token {token}"
        return None

    def check(self) -> None:
        """Raise ValueError naming the bad field."""
        problem = self.problem()
        if problem is not None:
            raise ValueError(problem[1])

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE

    @property
    def needs_history(self) -> bool:
        """True when sampling reads the request's earlier tokens (a penalty is set)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    @property
    def processes_logits(self) -> bool:
        """True when the logits are changed before sampling (bias or a penalty): greedy is then not a plain argmax."""
        return bool(self.logit_bias) or self.needs_history

