"""`stallfree serve`: the per-node serving daemon (OpenAI API, /metrics, admin API, drain on SIGTERM).

Start-up: the HTTP server answers at once (/health 200, /ready 503 "loading model"); a start-up thread
loads the model (or builds the sim backend), measures the profile on this device, picks the starting
token budget from --tpot-slo-ms when --token-budget is auto, and starts the engine loop; /ready turns
200 then. A start-up failure exits with status 1.
"""
from __future__ import annotations

import argparse
import logging
import sys
import threading
from dataclasses import dataclass
from typing import Any

from stallfree.contracts import Ceilings, Tuning, TuningError, min_budget_for, validate_tuning

log = logging.getLogger("stallfree.serve")

# The budget a daemon starts with when told neither a budget nor a TPOT SLO.
DEFAULT_TOKEN_BUDGET = 512


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="stallfree serve", description=__doc__.splitlines()[0])
    m = p.add_argument_group("model and device")
    m.add_argument("--model", default="smollm2-135m",
                   help="smollm2-135m (embedded GGUF), a shape name (random weights), a HF folder or a .gguf file")
    m.add_argument("--served-model-name", default=None, help="the name clients send as `model` (default: --model)")
    m.add_argument("--backend", choices=["model", "sim"], default="model",
                   help="model: run the model; sim: the cost model's time passes instead (same scheduler and API)")
    m.add_argument("--hardware", default="h100", help="sim backend: hardware preset (a100, h100, h200, ...)")
    m.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    m.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto")
    m.add_argument("--attention-backend", choices=["auto", "cpu", "torch", "triton", "flashinfer"], default="auto")
    m.add_argument("--threads", type=int, default=0,
                   help="torch threads on the CPU (0: the cores this process is given: affinity, cgroup quota)")
    m.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    m.add_argument("--seed", type=int, default=0)

    c = p.add_argument_group("KV cache")
    c.add_argument("--block-size", type=int, default=16)
    c.add_argument("--num-kv-blocks", type=int, default=0, help="0: size from --kv-memory-fraction")
    c.add_argument("--kv-memory-fraction", type=float, default=0.9)
    c.add_argument("--no-prefix-caching", action="store_true")

    s = p.add_argument_group("scheduling (ceilings fixed at start; live knobs move below them)")
    s.add_argument("--max-token-budget", type=int, default=2048, help="ceiling of the token budget")
    s.add_argument("--max-num-seqs-ceiling", type=int, default=256, help="ceiling of max_num_seqs")
    s.add_argument("--token-budget", default="auto",
                   help="tokens per iteration, or auto: from the profile and --tpot-slo-ms "
                        f"(else {DEFAULT_TOKEN_BUDGET})")
    s.add_argument("--max-num-seqs", type=int, default=64)
    s.add_argument("--max-partial-prefills", type=int, default=1)
    s.add_argument("--long-prefill-threshold", type=int, default=0, help="0: no per-request prefill cap")
    s.add_argument("--tpot-slo-ms", type=float, default=None, help="TPOT target: picks the starting budget")
    s.add_argument("--policy", choices=["stall_free", "prefill_priority", "decode_priority"], default="stall_free",
                   help="scheduling policy (the two others are baselines)")
    s.add_argument("--no-profile", action="store_true", help="skip the start-up profile (needs --token-budget N)")
    s.add_argument("--profile-max-seconds", type=float, default=60.0, help="time cap on the start-up profile")

    h = p.add_argument_group("HTTP")
    h.add_argument("--host", default="0.0.0.0")
    h.add_argument("--port", type=int, default=8000)
    h.add_argument("--admin-token-file", default=None, help="file holding the admin bearer token "
                   "(else env STALLFREE_ADMIN_TOKEN; without one the admin API is closed)")
    h.add_argument("--api-key-file", default=None, help="file holding the API key (else env STALLFREE_API_KEY; "
                   "without one the inference API is open)")
    h.add_argument("--max-queue-requests", type=int, default=1024, help="queued requests before 429 (0: no bound)")
    h.add_argument("--max-queue-tokens", type=int, default=0, help="queued prompt tokens before 429 (0: no bound)")
    h.add_argument("--max-body-bytes", type=int, default=4 << 20, help="request bodies above this get 413")
    h.add_argument("--drain-timeout-s", type=float, default=30.0, help="grace period for in-flight requests")
    h.add_argument("--stats-window-s", type=float, default=30.0, help="sliding window of /admin/stats")
    h.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return p


@dataclass
class ServeOptions:
    """The parsed command line, checked; what the start-up thread and the app need."""

    args: argparse.Namespace
    ceilings: Ceilings
    tuning: Tuning  # the starting tuning (budget may still move to the profile's choice)
    auto_budget: bool
    served_model_name: str
    admin_token: str | None
    api_key: str | None


def parse_options(argv: list[str]) -> ServeOptions:
    """Parse and check the command line; ValueError names the bad flag."""
    from stallfree.node_daemon.server.auth import ADMIN_TOKEN_ENV, API_KEY_ENV, load_secret

    args = build_parser().parse_args(argv)
    for flag in ("block_size", "max_token_budget", "max_num_seqs_ceiling", "max_num_seqs", "max_partial_prefills",
                 "max_body_bytes"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be positive, got {getattr(args, flag)}")
    for flag in ("num_kv_blocks", "long_prefill_threshold", "max_queue_requests", "max_queue_tokens"):
        if getattr(args, flag) < 0:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 0, got {getattr(args, flag)}")
    for flag in ("drain_timeout_s", "stats_window_s", "profile_max_seconds"):
        if getattr(args, flag) <= 0:
            raise ValueError(f"--{flag.replace('_', '-')} must be positive, got {getattr(args, flag)}")
    if args.tpot_slo_ms is not None and args.tpot_slo_ms <= 0:
        raise ValueError(f"--tpot-slo-ms must be positive, got {args.tpot_slo_ms}")
    if args.max_model_len is not None and args.max_model_len < 2:
        raise ValueError(f"--max-model-len must be at least 2, got {args.max_model_len}")
    if not 0.0 < args.kv_memory_fraction <= 1.0:
        raise ValueError(f"--kv-memory-fraction must be in (0, 1], got {args.kv_memory_fraction}")
    if not 0 < args.port < 65536:
        raise ValueError(f"--port must be 1..65535, got {args.port}")

    ceilings = Ceilings(max_token_budget=args.max_token_budget, max_num_seqs=args.max_num_seqs_ceiling)
    auto_budget = args.token_budget == "auto"
    max_num_seqs = min(args.max_num_seqs, ceilings.max_num_seqs)
    if auto_budget:
        budget = min(ceilings.max_token_budget, max(DEFAULT_TOKEN_BUDGET, min_budget_for(max_num_seqs)))
    else:
        try:
            budget = int(args.token_budget)
        except ValueError:
            raise ValueError(f"--token-budget must be an integer or auto, got {args.token_budget!r}") from None
    if args.no_profile and auto_budget and args.tpot_slo_ms is not None:
        raise ValueError("--tpot-slo-ms with --token-budget auto needs the profile: drop --no-profile")
    tuning = Tuning(token_budget=budget, max_num_seqs=max_num_seqs, max_partial_prefills=args.max_partial_prefills,
                    long_prefill_threshold=args.long_prefill_threshold)
    try:
        validate_tuning(tuning, ceilings)
    except TuningError as exc:
        raise ValueError(f"bad starting tuning: {exc}") from None
    return ServeOptions(
        args=args, ceilings=ceilings, tuning=tuning, auto_budget=auto_budget,
        served_model_name=args.served_model_name or args.model,
        admin_token=load_secret(args.admin_token_file, ADMIN_TOKEN_ENV),
        api_key=load_secret(args.api_key_file, API_KEY_ENV),
    )


def engine_config(opts: ServeOptions):
    from stallfree.node_daemon.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig

    a = opts.args
    return EngineConfig(
        model=ModelConfig(model=a.model, device=a.device, dtype=a.dtype, attention_backend=a.attention_backend,
                          max_model_len=a.max_model_len, seed=a.seed, threads=a.threads),
        cache=CacheConfig(block_size=a.block_size, num_blocks=a.num_kv_blocks, kv_memory_fraction=a.kv_memory_fraction,
                          enable_prefix_caching=not a.no_prefix_caching),
        scheduler=SchedulerConfig(ceilings=opts.ceilings, tuning=opts.tuning, policy=a.policy,
                                  max_model_len=a.max_model_len or 2048),
        backend=a.backend,
    )


def build_llm_engine(opts: ServeOptions, observer: Any):
    """The synchronous engine over the real model or the sim backend; returns (engine, device name)."""
    from stallfree.node_daemon.engine.engine import LLMEngine

    config = engine_config(opts)
    a = opts.args
    if a.backend == "sim":
        from stallfree.node_daemon.sim.backend import (build_cost_model, build_sim_executor, resolve_shape,
                                                       sim_num_kv_blocks, sim_tokenizer)

        dtype = "bfloat16" if a.dtype == "auto" else a.dtype
        cost_model = build_cost_model(a.model, a.hardware, dtype)
        if not config.cache.num_blocks:
            config.cache.num_blocks = sim_num_kv_blocks(cost_model, a.block_size, a.kv_memory_fraction)
        shape = resolve_shape(a.model)
        config.model.max_model_len = a.max_model_len or shape.max_position_embeddings
        config.scheduler.max_model_len = config.model.max_model_len
        executor = build_sim_executor(cost_model)
        engine = LLMEngine(config, executor=executor, tokenizer=sim_tokenizer(shape), observer=observer)
        return engine, f"sim:{cost_model.hardware.name}"
    engine = LLMEngine(config, observer=observer)
    device = engine.executor.runner.device
    if device.type == "cuda":
        import torch

        return engine, f"cuda:{torch.cuda.get_device_name(device)}"
    return engine, "cpu"


def start_engine(opts: ServeOptions, daemon) -> None:
    """Load, profile, tune, start the engine loop; then the daemon is ready. Runs in the start-up thread."""
    from stallfree.node_daemon.engine.async_engine import AsyncEngine
    from stallfree.node_daemon.engine.observers import FanoutObserver
    from stallfree.node_daemon.engine.profiler import ProfileSettings, measure_profile, starting_tuning
    from stallfree.node_daemon.server.app import LiveCounts

    daemon.starting = "loading model"
    engine, device = build_llm_engine(opts, FanoutObserver(daemon.metrics, daemon.stats))
    if not opts.args.no_profile:
        daemon.starting = "profiling"
        daemon.profile = measure_profile(engine, device, ProfileSettings(max_seconds=opts.args.profile_max_seconds))
        log.info("profile on %s: %s", device, ", ".join(f"{p.tokens} tok {p.iteration_ms:.2f} ms"
                                                      for p in daemon.profile.mixed))
    if opts.auto_budget and opts.args.tpot_slo_ms is not None and daemon.profile is not None and daemon.profile.mixed:
        tuning = starting_tuning(daemon.profile, opts.args.tpot_slo_ms, engine.ceilings, engine.get_tuning())
        engine.set_tuning(tuning)
        log.info("TPOT SLO %.1f ms: starting token budget %d, max_num_seqs %d", opts.args.tpot_slo_ms,
                 tuning.token_budget, tuning.max_num_seqs)
    scheduler, kv_cache = engine.scheduler, engine.kv_cache
    daemon.vocab_size = engine.vocab_size
    daemon.kv_capacity_tokens = kv_cache.num_blocks * kv_cache.block_size
    daemon.live_counts = lambda: LiveCounts(scheduler.num_waiting, scheduler.num_running, kv_cache.usage)
    daemon.metrics.set_tuning(engine.get_tuning())
    async_engine = AsyncEngine(engine, opts.served_model_name)
    daemon.engine_error = lambda: None if async_engine.is_running else "the engine loop is not running"
    daemon.engine = async_engine
    daemon.starting = None
    log.info("serving %s on %s (max_model_len %d, %d KV blocks of %d)", opts.served_model_name, device,
             engine.max_model_len, kv_cache.num_blocks, kv_cache.block_size)


def build_daemon(opts: ServeOptions):
    """The Daemon (not started) and its FastAPI app."""
    from stallfree.node_daemon.server.metrics import EngineMetrics
    from stallfree.node_daemon.server.app import Daemon, create_app
    from stallfree.node_daemon.server.auth import Auth
    from stallfree.node_daemon.server.backpressure import AdmissionControl
    from stallfree.node_daemon.server.drain import DrainState
    from stallfree.node_daemon.engine.stats_window import StatsWindow

    a = opts.args
    stats = StatsWindow(a.stats_window_s)
    daemon = Daemon(
        metrics=EngineMetrics(opts.served_model_name),
        stats=stats,
        admission=AdmissionControl(a.max_queue_requests, a.max_queue_tokens, stats.prefill_tokens_per_s),
        drain=DrainState(a.drain_timeout_s),
        auth=Auth(opts.admin_token, opts.api_key),
        served_model_name=opts.served_model_name,
        tpot_slo_ms=a.tpot_slo_ms,
        starting="loading model",
    )
    return daemon, create_app(daemon, max_body_bytes=a.max_body_bytes)


async def abort_in_flight(daemon, request_id: str) -> None:
    if daemon.engine is not None:
        await daemon.engine.abort(request_id)


def main(argv: list[str]) -> int:
    try:
        opts = parse_options(argv)
    except ValueError as exc:
        print(f"stallfree serve: error: {exc}", file=sys.stderr)
        return 2
    import prometheus_client
    import uvicorn

    from stallfree.node_daemon.server.drain import DrainingServer

    prometheus_client.disable_created_metrics()  # no *_created series: one fewer sample per metric per scrape

    logging.basicConfig(level=opts.args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    daemon, app = build_daemon(opts)
    config = uvicorn.Config(app, host=opts.args.host, port=opts.args.port, log_level=opts.args.log_level,
                            access_log=False, timeout_graceful_shutdown=5, lifespan="off")
    server = DrainingServer(config, daemon.drain, lambda rid: abort_in_flight(daemon, rid))
    failure: list[BaseException] = []

    def start_up() -> None:
        try:
            start_engine(opts, daemon)
        except BaseException as exc:  # noqa: BLE001 - any start-up failure ends the daemon with status 1
            log.error("start-up failed: %s: %s", type(exc).__name__, exc, exc_info=not isinstance(exc, ValueError))
            failure.append(exc)
            server.should_exit = True

    threading.Thread(target=start_up, name="stallfree-startup", daemon=True).start()
    try:
        server.run()
    finally:
        engine = daemon.engine
        if engine is not None:
            engine.shutdown_sync()
    if failure:
        print(f"stallfree serve: error: {failure[0]}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
