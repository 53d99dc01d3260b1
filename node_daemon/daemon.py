"""The serving daemon's start-up (`stallfree serve` parses its flags in cli/serve.py and calls `run`).

The HTTP server answers at once (/health 200, /ready 503 "loading model"); a start-up thread
loads the model (or builds the sim backend), reads this engine's profile from the profile cache or
measures it within --profile-max-seconds (node_daemon/measure/profiler.py, profile_cache.py; while the compiled
CPU forward is still compiling: without a TPOT SLO later, on the idle engine, else now and again once it is in
use), picks the starting token budget from --tpot-slo-ms when --token-budget is auto, has the scheduler cut
prefill chunks over a long prefix to the budget's iteration time (node_daemon/engine/iteration_cost.py), and
starts the engine loop; /ready turns 200 then. Each step logs a "start-up:" line with its duration. A start-up
failure ends the daemon (`run` returns it).
"""
from __future__ import annotations

import logging
import threading
from typing import Any

from stallfree.node_daemon.serve_config import ServeConfig

log = logging.getLogger("stallfree.serve")

# The starting token budget of a CPU daemon told neither a budget nor a TPOT SLO. On the CPU a chunk's attention
# grows with its square while an iteration's fixed cost is small, so tokens per second peak near 256 tokens an
# iteration (`stallfree bench iteration --seqs 16 --chunk C --compiled-decode now`, 1 thread: 657, 754, 713 and
# 646 tok/s at C = 128, 256, 512, 1024), and the decodes beside a chunk wait half as long as at the general
# default (512).
CPU_TOKEN_BUDGET = 256


def engine_config(opts: ServeConfig):
    from stallfree.node_daemon.engine.config import CacheConfig, EngineConfig, SchedulerConfig
    from stallfree.node_daemon.engine.speculation import SpeculativeConfig
    from stallfree.node_daemon.models.config import ModelConfig

    return EngineConfig(
        model=ModelConfig(model=opts.model, device=opts.device, dtype=opts.dtype,
                          attention_backend=opts.attention_backend, max_model_len=opts.max_model_len, seed=opts.seed,
                          threads=opts.threads, compiled_decode="background", release_dense_weights=True,
                          cpu_dense_copy=opts.cpu_dense_copy),
        cache=CacheConfig(block_size=opts.block_size, num_blocks=opts.num_kv_blocks,
                          kv_memory_fraction=opts.kv_memory_fraction, enable_prefix_caching=not opts.no_prefix_caching),
        scheduler=SchedulerConfig(ceilings=opts.ceilings, tuning=opts.tuning, max_model_len=opts.max_model_len or 2048,
                                  speculative=SpeculativeConfig(method=opts.speculative,
                                                                max_draft=opts.speculative_max_draft,
                                                                max_rows=opts.speculative_max_rows)),
        backend=opts.backend,
    )


def build_llm_engine(opts: ServeConfig, observer: Any):
    """The synchronous engine over the real model or the sim backend; returns (engine, device name)."""
    from stallfree.node_daemon.engine.engine import LLMEngine

    config = engine_config(opts)
    if opts.backend == "sim":
        from stallfree.node_daemon.sim.backend import (build_cost_model, build_sim_executor, resolve_shape,
                                                       sim_num_kv_blocks, sim_tokenizer)

        dtype = "bfloat16" if opts.dtype == "auto" else opts.dtype
        cost_model = build_cost_model(opts.model, opts.hardware, dtype, tflops=opts.tflops, hbm_tbps=opts.hbm_tbps,
                                      overhead_ms=opts.overhead_ms)
        if not config.cache.num_blocks:
            config.cache.num_blocks = sim_num_kv_blocks(cost_model, opts.block_size, opts.kv_memory_fraction)
        shape = resolve_shape(opts.model)
        config.model.max_model_len = opts.max_model_len or shape.max_position_embeddings
        config.scheduler.max_model_len = config.model.max_model_len
        executor = build_sim_executor(cost_model)
        engine = LLMEngine(config, executor=executor, tokenizer=sim_tokenizer(shape), observer=observer)
        return engine, f"sim:{cost_model.hardware.name}"
    if str(opts.model).endswith(".gguf"):
        from stallfree.node_daemon.text.tokenizer import start_from_gguf

        start_from_gguf(str(opts.model))  # its tokenizer is built while the weights decode
    engine = LLMEngine(config, observer=observer)
    device = engine.executor.runner.device
    if device.type == "cuda":
        import torch

        return engine, f"cuda:{torch.cuda.get_device_name(device)}"
    return engine, "cpu"


def start_engine(opts: ServeConfig, daemon) -> None:
    """Load, profile, tune, start the engine loop; then the daemon is ready. Runs in the start-up thread.

    Every step logs a progress line with its duration; /ready stays false until the last one."""
    import gc
    import time

    from stallfree.node_daemon.engine.async_engine import AsyncEngine
    from stallfree.node_daemon.engine.observers import FanoutObserver
    from stallfree.node_daemon.measure.profiler import starting_tuning
    from stallfree.node_daemon.measure.stall_watch import StallWatch, compute_threads
    from stallfree.node_daemon.process_memory import return_freed_memory
    from stallfree.node_daemon.server.startup import LiveCounts, Phase, Serving
    from stallfree.node_daemon.server.structured_requests import StructuredOutputs

    started = time.monotonic()
    daemon.startup.advance(Phase.LOADING)
    log.info("start-up: loading %s (%s backend)", opts.model, opts.backend)
    engine, device = build_llm_engine(opts, FanoutObserver(daemon.metrics, daemon.stats))
    engine.on_observer_error = daemon.metrics.record_observer_error
    log.info("start-up: model loaded on %s in %.1f s", device, time.monotonic() - started)
    # What load made lives as long as the process: out of the collector's way, so no full collection
    # walks it while serving (a pause of the engine thread that no log would explain). Frozen without a collection
    # first: one walks the load's ~230k objects (116 ms of Gemma 3's 1.9 s start) and found nothing to free; the
    # first quiet spell collects once instead (_collect_start_up_garbage).
    gc.freeze()
    return_freed_memory(after="the load")
    profile, retry = None, None
    if not opts.no_profile:
        daemon.startup.advance(Phase.PROFILING)
        # Measured before serving only where it is read at once (a TPOT SLO's starting budget, the operator's
        # daemons) or costs nothing (the simulator's); a real model without an SLO serves first.
        profile, retry = _startup_profile(opts, engine, device,
                                          serve_first=opts.tpot_slo_ms is None and opts.backend == "model")
    if opts.auto_budget and opts.tpot_slo_ms is not None and profile is not None and profile.mixed:
        tuning = starting_tuning(profile, opts.tpot_slo_ms, engine.ceilings, engine.get_tuning())
        engine.set_tuning(tuning)
        predicted = profile.iteration_ms_at(tuning.token_budget)
        log.info("start-up: TPOT SLO %.1f ms: starting token budget %d, max_num_seqs %d (predicted iteration "
                 "%.1f ms)", opts.tpot_slo_ms, tuning.token_budget, tuning.max_num_seqs, predicted)
        if predicted > opts.tpot_slo_ms:
            log.warning("start-up: even the smallest budget's iteration (%.1f ms predicted) misses the TPOT SLO "
                        "%.1f ms on this engine", predicted, opts.tpot_slo_ms)
    elif opts.auto_budget and opts.tpot_slo_ms is None and opts.backend == "model" and device == "cpu":
        engine.set_tuning(cpu_starting_tuning(engine.get_tuning(), engine.ceilings))
        log.info("start-up: token budget %d (the CPU's default: --token-budget N or --tpot-slo-ms choose another)",
                 engine.get_tuning().token_budget)
    scheduler, kv_cache = engine.scheduler, engine.kv_cache
    use_profile(opts, engine, profile)
    if profile is not None:
        daemon.startup.give_profile(profile)
    num_blocks = kv_cache.num_blocks
    daemon.metrics.set_tuning(engine.get_tuning())
    ceilings = engine.ceilings
    engine_info = {
        "backend": opts.backend, "device": device, "dtype": _engine_dtype(engine, opts.dtype),
        "attention_backend": opts.attention_backend, "block_size": kv_cache.block_size, "num_kv_blocks": num_blocks,
        "max_model_len": engine.max_model_len, "max_token_budget": ceilings.max_token_budget,
        "max_num_seqs": ceilings.max_num_seqs, "policy": "stall_free", "prefix_caching": not opts.no_prefix_caching}
    daemon.metrics.set_engine_config(engine_info)
    if opts.backend == "model" and device == "cpu":
        _report_cpu_paths(daemon, engine, engine_info)
    gc.freeze()  # the profile's leftovers too
    return_freed_memory(after="the profile")
    async_engine = AsyncEngine(engine, opts.served_model_name, watch=StallWatch(threads=compute_threads()))
    async_engine.after_each_burst(_release_after_burst)  # the heap an iteration reuses, handed back when quiet
    if retry is not None:
        def take(measured) -> None:  # on the engine thread: the daemon's one hand-off after start-up
            daemon.startup.give_profile(measured)
            use_profile(opts, engine, measured, when="profile")

        retry.on_profile = take
        async_engine.when_idle(retry.delay_s, retry)
    async_engine.when_quiet(_collect_start_up_garbage)
    structured = StructuredOutputs.build(engine.tokenizer, engine.vocab_size, opts.tool_call_parser,
                                         constrained=engine.supports_grammars)
    if structured.compiler is not None:
        # The grammar library's vocabulary holds the GIL while it builds (SmolLM2's 49k tokens: 0.14-0.2 s, Gemma 3's
        # 262k: 1.2 s): built once the engine is quiet, or by the first structured request if that comes first, so
        # that it never delays ready or a stream (a request arriving during the build waits for it once).
        async_engine.when_quiet(structured.compiler.ll_tokenizer)
    daemon.startup.ready(Serving(
        engine=async_engine, limits=engine.limits, structured=structured,
        max_chars_per_token=max_chars_per_token(engine.tokenizer),
        # Blocks in use plus those admitted requests may still take (by the output-length estimate).
        live_counts=lambda: LiveCounts(scheduler.num_waiting, scheduler.num_running, kv_cache.usage,
                                       scheduler.num_partial_prefills, scheduler.kv_reserved),
        engine_error=lambda: None if async_engine.is_running else "the engine loop is not running"))
    log.info("start-up: ready in %.1f s (%.1f s since the process started): serving %s on %s (max_model_len %d, "
             "%d KV blocks of %d)", time.monotonic() - started, _process_age_s(), opts.served_model_name, device,
             engine.max_model_len, kv_cache.num_blocks, kv_cache.block_size)


def _collect_start_up_garbage() -> None:
    """Once, on the engine thread in its first quiet spell: the full collection start-up skipped, over what it froze,
    so that no cycle the load left behind stays frozen for the process's life; then frozen again."""
    import gc

    gc.unfreeze()
    found = gc.collect()
    gc.freeze()
    if found:
        log.debug("quiet: %d unreachable objects from start-up collected", found)


def _release_after_burst() -> None:
    from stallfree.node_daemon.process_memory import release_freed_heap

    released = release_freed_heap()
    if released >= 1 << 20:
        log.debug("quiet: %d MB of freed heap returned to the system", released >> 20)


def _report_cpu_paths(daemon, engine, engine_info: dict) -> None:
    """The CPU's tier and the kernel each part of the forward takes, in the log and in /metrics' engine info, and
    each slow path (models/serving_paths.py) as a warning, in /metrics and in /admin/stats: now, and again once a
    background compile of the compiled forward has loaded."""
    from stallfree.node_daemon.models import cpu_decode
    from stallfree.node_daemon.models.serving_paths import slow_paths

    def report() -> None:
        runner = engine.executor.runner
        model = runner.model
        paths = cpu_decode.paths_taken(dense_copy=any(
            getattr(m, "packed", None) is not None for m in model.modules() if getattr(m, "int4", None) is not None))
        log.info("CPU paths: %s", ", ".join(f"{k} {v}" for k, v in paths.items()))
        daemon.metrics.set_engine_config({**engine_info, **{f"cpu_{k.removeprefix('cpu_')}": v
                                                            for k, v in paths.items()}})
        compiled = runner.cpu_decode is not None and cpu_decode.is_loaded()
        why = cpu_decode.unsupported(model) or cpu_decode.why_not() or (None if runner.cpu_decode else "switched off")
        slow = slow_paths(runner.loaded, compiled, why)
        for line in slow:
            log.warning("serving on a slow path: %s", line)
        daemon.metrics.set_slow_paths(slow)

    report()
    cpu_decode.when_loaded(report)


def use_profile(opts: ServeConfig, engine, profile, when: str = "start-up") -> None:
    """What the engine takes from its profile once it has one (at start-up, or measured later while idle): a
    chunk of a long prompt's tail attends to all of it, so the scheduler cuts it to keep the iteration as long as
    the budget means, by what served iterations show a cached prefix costs (the profile cannot see it)."""
    from stallfree.profile_rules import SLO_MARGIN
    from stallfree.node_daemon.engine.iteration_cost import OnlineIterationCost, prior_per_prefix_pair

    if profile is None or not profile.mixed or opts.backend != "model" or opts.no_prefix_cut:
        return
    target = SLO_MARGIN * opts.tpot_slo_ms if opts.tpot_slo_ms is not None else None
    cost = OnlineIterationCost(profile, target, prior_per_prefix_pair(profile, engine.executor.loaded.shape))
    engine.scheduler.set_prefix_cost(cost)
    engine.scheduler.set_tpot_budget(cost, opts.tpot_slo_ms)  # a request's tighter TPOT target caps the budget
    log.info("%s: prefill chunks over a cached prefix are cut to the budget's iteration time%s (the prefix's cost "
             "learned from served iterations)", when,
             f" and to {target:.0f} ms (the TPOT SLO's iteration target)" if target else "")


def cpu_starting_tuning(tuning, ceilings):
    """CPU_TOKEN_BUDGET within the ceiling, never below the prefill room every running decode needs."""
    from dataclasses import replace

    from stallfree.contracts import min_budget_for

    budget = max(CPU_TOKEN_BUDGET, min_budget_for(tuning.max_num_seqs))
    return replace(tuning, token_budget=min(budget, ceilings.max_token_budget))


def _engine_dtype(engine, requested: str) -> str:
    """The dtype the model runs in (the loaded model's when there is one)."""
    runner = getattr(engine.executor, "runner", None)
    dtype = getattr(getattr(runner, "loaded", None), "dtype", None)
    return str(dtype).removeprefix("torch.") if dtype is not None else requested


def max_chars_per_token(tokenizer) -> int | None:
    """The longest text one token stands for, so a prompt's length bounds its token count from below."""
    backend = getattr(tokenizer, "backend", None)
    if backend is None:
        return None
    longest = getattr(tokenizer, "longest_piece_chars", None)
    if longest is None:
        longest = max((len(token) for token in backend.get_vocab(with_added_tokens=True)), default=0)
    if longest < 1:
        return None
    # A normalizer may shrink text (NFC composes characters): a wide margin, never a refused prompt that fits.
    return longest * (4 if tokenizer.normalizes else 1)


def _process_age_s() -> float:
    """Seconds since this process started (interpreter start and imports included), from /proc."""
    import os
    import time

    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return uptime - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return float("nan")


def _startup_profile(opts: ServeConfig, engine, device: str, serve_first: bool = False):
    """The profile from the cache, else measured within the time budget; and a retry when it is not trusted, or
    when it timed the Python path while the compiled CPU forward compiles (it is replaced once that is in use).

    With `serve_first` (a real model and no TPOT SLO: neither the starting budget nor an operator reads the profile),
    nothing is measured before the daemon serves: while the compiled forward compiles, the retry reads or
    measures the profile on the idle engine thread once it is in use (a fresh install's first start: about 5 s
    shorter); with no profile cached for this engine (a new model file), the retry measures it on the idle engine
    (4.4 s that Gemma 3 270M's first start would otherwise spend before serving)."""
    from stallfree.node_daemon.measure.profile_cache import ProfileCache, profile_key
    from stallfree.node_daemon.measure.profiler import ProfileSettings, run_profile
    from stallfree.node_daemon.models import cpu_decode

    settings = ProfileSettings(max_seconds=opts.profile_max_seconds,
                               progress=lambda line: log.info("start-up: %s", line))
    cache = None if opts.no_profile_cache else ProfileCache(opts.profile_cache_dir)
    compiling = cpu_decode.is_building()
    if serve_first and compiling:
        log.info("start-up: profile deferred: the compiled CPU forward is still compiling (the Python path serves "
                 "meanwhile); read or measured on the idle engine once it is in use")
        return None, _Remeasure(settings, cache, device, delay_s=_COMPILE_POLL_S)
    key = profile_key(engine, device, settings) if cache is not None else None
    later = _Remeasure(settings, cache, device, delay_s=_COMPILE_POLL_S) if compiling else None
    if cache is not None:
        cached, why = cache.load(key)
        if cached is not None:
            log.info("start-up: %s (%d mixed points, %d decode-only)", why, len(cached.mixed), len(cached.decode_only))
            return cached, later
        if serve_first:
            log.info("start-up: %s: serving now with the default budget; measured on the idle engine (a request "
                     "stops it) and cached", why)
            return None, _Remeasure(settings, cache, device, delay_s=_IDLE_PROFILE_DELAY_S)
        log.info("start-up: %s: measuring (time budget %g s)", why, opts.profile_max_seconds)
    run = run_profile(engine, device, settings)
    log.info("start-up: profile on %s in %.1f s: %s", device, run.seconds,
             ", ".join(f"{p.tokens} tok {p.iteration_ms:.1f} ms" for p in run.profile.mixed) or "no mixed point")
    if run.trusted:
        if cache is not None:
            path = cache.store(key, run.profile, {"seconds": run.seconds, "cpu_share": run.cpu_share})
            if path is not None:
                log.info("start-up: profile cached at %s", path)
        return run.profile, later
    log.warning("start-up: the profile is not trusted (%s): served with, not cached; measured again when idle",
                "; ".join(run.warnings) or "stopped early")
    return run.profile, later or _Remeasure(settings, cache, device)


# How often a deferred profile looks whether the compiled forward has loaded.
_COMPILE_POLL_S = 2.0
# A deferred profile's first try, after which its tries back off (x2); AsyncEngine also holds every idle task
# until the engine has been quiet for a while, so a client's first requests go first.
_IDLE_PROFILE_DELAY_S = 1.0


class _Remeasure:
    """Measure the profile on the idle engine thread until one run is trusted (then cache it): again after an
    untrusted start-up run, for the first time after a deferred one, or again once the compiled CPU forward that
    was compiling is in use. It waits for that compile, then reads the cache first (the compiled forward's
    arrival changes the key: a profile measured on an earlier start may be there).

    A request arriving mid-run stops it at the next iteration (should_stop), so serving waits at most
    one profile iteration; backs off (x2) between tries, gives up after `tries`. A busy machine is judged by the
    run itself (its own CPU share, profiler.MIN_CPU_SHARE), not by the node's load average, which counts other
    processes that may not take this one's cores. on_profile(profile) is called with each profile it gives the
    daemon (on the engine thread)."""

    def __init__(self, settings, cache, device: str, delay_s: float = 30.0, tries: int = 5) -> None:
        self.settings, self.cache, self.device = settings, cache, device
        self.delay_s, self.tries = delay_s, tries
        self.on_profile = lambda profile: None

    def __call__(self, engine, should_stop) -> float | None:
        """Runs on the engine thread; returns the delay before the next try, or None when done."""
        import dataclasses

        from stallfree.node_daemon.measure.profile_cache import profile_key
        from stallfree.node_daemon.measure.profiler import run_profile
        from stallfree.node_daemon.models import cpu_decode

        if cpu_decode.is_building():
            return _COMPILE_POLL_S
        key = profile_key(engine, self.device, self.settings) if self.cache is not None else None
        if self.cache is not None:
            cached, why = self.cache.load(key)
            if cached is not None:
                log.info("profile: %s", why)
                self.on_profile(cached)
                return None
        self.tries -= 1
        settings = dataclasses.replace(self.settings, should_stop=should_stop, progress=None)
        run = run_profile(engine, self.device, settings)
        if run.trusted:
            self.on_profile(run.profile)
            where = self.cache.store(key, run.profile, {"seconds": run.seconds, "cpu_share": run.cpu_share}) \
                if self.cache is not None else None
            log.info("profile measured while idle in %.1f s: %s%s", run.seconds,
                     ", ".join(f"{p.tokens} tok {p.iteration_ms:.1f} ms" for p in run.profile.mixed),
                     f" (cached at {where})" if where else "")
            return None
        log.info("profile re-measure %s (%s)", "interrupted by a request" if run.stopped else "still not trusted",
                 "; ".join(run.warnings) or "stopped")
        if self.tries <= 0:
            log.warning("profile: giving up measuring while idle; the daemon keeps the profile it has, if any "
                        "(not cached)")
            return None
        self.delay_s = max(self.delay_s, 30.0) * 2
        return self.delay_s


def build_daemon(opts: ServeConfig):
    """The Daemon (not started) and its FastAPI app."""
    from stallfree.node_daemon.server.metrics import EngineMetrics
    from concurrent.futures import ThreadPoolExecutor

    from stallfree.node_daemon.server.app import Daemon, create_app
    from stallfree.node_daemon.server.auth import Auth
    from stallfree.node_daemon.server.backpressure import AdmissionControl
    from stallfree.node_daemon.server.drain import DrainState
    from stallfree.node_daemon.measure.stats_window import StatsWindow

    stats = StatsWindow(opts.stats_window_s)
    daemon = Daemon(
        metrics=EngineMetrics(opts.served_model_name),
        stats=stats,
        admission=AdmissionControl(opts.max_queue_requests, opts.max_queue_tokens, stats.prefill_tokens_per_s),
        drain=DrainState(opts.drain_timeout_s),
        auth=Auth(opts.admin_token, opts.api_key),
        served_model_name=opts.served_model_name,
        tpot_slo_ms=opts.tpot_slo_ms,
        text_workers=ThreadPoolExecutor(opts.text_workers, thread_name_prefix="stallfree-text"),
    )
    return daemon, create_app(daemon, max_body_bytes=opts.max_body_bytes, body_timeout_s=opts.body_timeout_s)


def uvicorn_config(opts: ServeConfig, daemon, app):
    """uvicorn over the daemon's app with the connection limits (header deadline, connection cap)."""
    import uvicorn

    from stallfree.http_doors.connections import limited_h11_protocol

    protocol = limited_h11_protocol(opts.header_timeout_s, opts.max_connections, daemon.metrics.record_error)
    return uvicorn.Config(app, host=opts.host, port=opts.port, log_level=opts.log_level, access_log=False,
                          http=protocol,
                          timeout_graceful_shutdown=5, lifespan="off")


def probe_servers(opts: ServeConfig, daemon) -> list:
    """The probe listener on --probe-port (none with --probe-port 0)."""
    from stallfree.node_daemon.server.probes import probe_server

    return [probe_server(daemon, opts.host, opts.probe_port, opts.log_level)] if opts.probe_port else []


async def abort_in_flight(daemon, request_id: str) -> None:
    if daemon.engine is not None:
        await daemon.engine.abort(request_id)


def run(opts: ServeConfig) -> BaseException | None:
    """Serve until stopped (SIGTERM drains): the HTTP server at once, the engine from a start-up thread.

    Returns the start-up failure, if there was one (the server stops then)."""
    import prometheus_client

    from stallfree.node_daemon.server.drain import DrainingServer

    prometheus_client.disable_created_metrics()  # no *_created series: one fewer sample per metric per scrape
    from stallfree.node_daemon.process_memory import bound_heap_growth

    applied = bound_heap_growth()  # before the engine's and the server's threads make arenas of their own
    if applied:
        log.info("malloc: %s (variables of the environment choose others)",
                 ", ".join(f"{name}={value}" for name, value in applied.items()))
    daemon, app = build_daemon(opts)
    server = DrainingServer(uvicorn_config(opts, daemon, app), daemon.drain, lambda rid: abort_in_flight(daemon, rid),
                            companions=probe_servers(opts, daemon))
    failure: list[BaseException] = []

    def start_up() -> None:
        try:
            start_engine(opts, daemon)
        except BaseException as exc:  # noqa: BLE001 - any start-up failure ends the daemon with status 1
            log.error("start-up failed: %s: %s", type(exc).__name__, exc, exc_info=not isinstance(exc, ValueError))
            daemon.startup.failed(f"{type(exc).__name__}: {exc}")
            failure.append(exc)
            server.should_exit = True

    threading.Thread(target=start_up, name="stallfree-startup", daemon=True).start()
    try:
        server.run()
    finally:
        engine = daemon.engine
        if engine is not None:
            engine.shutdown_sync()
    return failure[0] if failure else None
