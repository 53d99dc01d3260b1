"""The daemon's configuration: typed, frozen, checked once when it is built (cli/serve.py builds it from the flags).

A field named like a flag (`block_size` is `--block-size`) so that an error names the flag to fix; the starting
token budget is resolved ("auto" picks a default the start-up may still replace from the profile).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from stallfree.contracts import Ceilings, Tuning, TuningError, validate_tuning
from stallfree.node_daemon.text.tool_calls.formats import format_named


@dataclass(frozen=True, kw_only=True)
class ServeConfig:
    # model and device
    model: str
    served_model_name: str
    backend: Literal["model", "sim"]
    hardware: str
    tflops: float | None
    hbm_tbps: float | None
    overhead_ms: float | None
    device: Literal["auto", "cpu", "cuda"]
    dtype: str
    attention_backend: str
    cpu_dense_copy: Literal["auto", "on", "off"]
    threads: int
    max_model_len: int | None
    seed: int
    # KV cache
    block_size: int
    num_kv_blocks: int
    kv_memory_fraction: float
    no_prefix_caching: bool
    # scheduling: ceilings fixed at start, the starting tuning below them
    max_token_budget: int
    max_num_seqs_ceiling: int
    token_budget: int
    auto_budget: bool  # --token-budget auto: the profile and --tpot-slo-ms may choose another at start
    max_num_seqs: int
    max_partial_prefills: int
    long_prefill_threshold: int
    tpot_slo_ms: float | None
    no_profile: bool
    no_prefix_cut: bool
    profile_max_seconds: float
    profile_cache_dir: str | None
    no_profile_cache: bool
    # HTTP
    host: str
    port: int
    probe_port: int
    max_queue_requests: int
    max_queue_tokens: int
    max_body_bytes: int
    header_timeout_s: float
    body_timeout_s: float
    max_connections: int
    text_workers: int
    drain_timeout_s: float
    stats_window_s: float
    log_level: str
    tool_call_parser: str | None = None  # None: detected from the chat template (text/tool_calls/formats.py)
    speculative: Literal["off", "ngram"] = "off"  # n-gram drafts verified inside the budget (engine/speculation.py)
    speculative_max_draft: int = 8
    speculative_max_rows: int = 0  # 0: the executor's (engine/model_executor.py speculation_rows)
    admin_token: Any = None  # a watched secret (server/auth.py), or None: the admin API is closed
    api_key: Any = None  # a watched secret, or None: the inference API is open

    def __post_init__(self) -> None:
        for problem in _problems(self):
            raise ValueError(problem)

    @property
    def ceilings(self) -> Ceilings:
        return Ceilings(max_token_budget=self.max_token_budget, max_num_seqs=self.max_num_seqs_ceiling)

    @property
    def tuning(self) -> Tuning:
        """The starting tuning (the budget may still move to the profile's choice); max_num_seqs within its ceiling."""
        return Tuning(token_budget=self.token_budget, max_num_seqs=min(self.max_num_seqs, self.max_num_seqs_ceiling),
                      max_partial_prefills=self.max_partial_prefills,
                      long_prefill_threshold=self.long_prefill_threshold)


def _flag(field: str) -> str:
    return "--" + field.replace("_", "-")


def _problems(c: ServeConfig):
    """Each problem of the configuration, named by its flag (the first one is raised)."""
    for field in ("block_size", "max_token_budget", "max_num_seqs_ceiling", "max_num_seqs", "max_partial_prefills",
                  "max_body_bytes", "max_connections", "text_workers", "speculative_max_draft"):
        if getattr(c, field) < 1:
            yield f"{_flag(field)} must be positive, got {getattr(c, field)}"
    for field in ("num_kv_blocks", "long_prefill_threshold", "max_queue_requests", "max_queue_tokens",
                  "speculative_max_rows"):
        if getattr(c, field) < 0:
            yield f"{_flag(field)} must be >= 0, got {getattr(c, field)}"
    for field in ("drain_timeout_s", "stats_window_s", "profile_max_seconds", "header_timeout_s", "body_timeout_s"):
        if getattr(c, field) <= 0:
            yield f"{_flag(field)} must be positive, got {getattr(c, field)}"
    for field in ("tflops", "hbm_tbps", "overhead_ms"):
        value = getattr(c, field)
        if value is not None and c.backend != "sim":
            yield f"{_flag(field)} sets a figure of the sim backend: add --backend sim"
        if value is not None and (value < 0 or (value == 0 and field != "overhead_ms")):
            yield f"{_flag(field)} must be {'>= 0' if field == 'overhead_ms' else 'positive'}, got {value}"
    if c.tpot_slo_ms is not None and c.tpot_slo_ms <= 0:
        yield f"--tpot-slo-ms must be positive, got {c.tpot_slo_ms}"
    if c.max_model_len is not None and c.max_model_len < 2:
        yield f"--max-model-len must be at least 2, got {c.max_model_len}"
    if not 0.0 < c.kv_memory_fraction <= 1.0:
        yield f"--kv-memory-fraction must be in (0, 1], got {c.kv_memory_fraction}"
    if not 0 < c.port < 65536:
        yield f"--port must be 1..65535, got {c.port}"
    if not 0 <= c.probe_port < 65536 or c.probe_port == c.port:
        yield f"--probe-port must be 0 (none) or 1..65535 other than --port, got {c.probe_port}"
    if c.no_profile and c.auto_budget and c.tpot_slo_ms is not None:
        yield "--tpot-slo-ms with --token-budget auto needs the profile: drop --no-profile"
    if c.tool_call_parser is not None:
        try:
            format_named(c.tool_call_parser)
        except ValueError as exc:
            yield f"--tool-call-parser: {exc}"
    try:
        validate_tuning(c.tuning, c.ceilings)
    except TuningError as exc:
        yield f"bad starting tuning: {exc}"
