"""One `stallfree up` run: start the daemons, wait until ready, then control intervals (and, with the demo, its
load) until the run's end or a stop signal; then drain and report."""
from __future__ import annotations

import asyncio
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stallfree.contracts import Profile
from stallfree.loadgen.prompts import PromptBuilder
from stallfree.operator.api.spec import InferenceServiceSpec
from stallfree.operator.local.demo_run import DemoRun
from stallfree.operator.local.drain import drain
from stallfree.operator.local.load import LoadDriver
from stallfree.operator.local.report import report
from stallfree.operator.local.runtime import LocalRuntime
from stallfree.operator.local.view import LiveView


@dataclass(frozen=True)
class RunOptions:
    """How `stallfree up` runs one InferenceService (its flags, typed)."""

    demo: bool = False  # the built-in load: a TPOT breach, then demand beyond one replica's prefill capacity
    duration_s: float | None = None  # None: the demo's length, else until a stop signal
    threads_per_replica: int = 1
    start_timeout_s: float = 600.0
    interval_s: float | None = None  # None: the spec's control interval
    live: bool = True  # the live terminal view where stdout is a terminal; else one line per control step
    phase_scale: float = 1.0  # stretch (>1) or shrink (<1) the demo's load phases


def demo_spec(spec: InferenceServiceSpec, out: Path) -> InferenceServiceSpec:
    """The spec the demo starts from: a budget configured far above what the TPOT SLO allows on this hardware,
    so the tuner must find the way down from feedback (not from the profile); never a resumed run."""
    engine = spec.engine
    budget = engine.token_budget.model_copy(update={"initial": engine.ceilings.max_token_budget})
    recorded = out / "control-state.json"
    if recorded.exists():
        recorded.unlink()
        print(f"demo: starting from the spec, not from the control state an earlier run left in {out}", flush=True)
    return spec.model_copy(update={"engine": engine.model_copy(update={"token_budget": budget})})


def prompt_builder(spec: InferenceServiceSpec) -> PromptBuilder:
    """Prompts of exact token lengths, counted by the tokenizer the daemons use."""
    from stallfree.node_daemon.text.tokenizer import load_tokenizer

    model = spec.model
    if model.source == "embedded":
        from stallfree.node_daemon.models.gguf_loader import embedded_gguf_path

        return PromptBuilder(load_tokenizer(embedded_gguf_path()))
    if model.source == "random":
        return PromptBuilder(load_tokenizer(model.name))  # the byte-level tokenizer of that shape
    return PromptBuilder(load_tokenizer(model.path))


async def fetch_profile(runtime: LocalRuntime) -> Profile:
    replica = runtime.daemons.replicas[0]
    response = await runtime.client.get(f"{replica.url}/admin/profile", timeout=5.0,
                                        headers={"Authorization": f"Bearer {runtime.admin_token}"})
    response.raise_for_status()
    return Profile.from_dict(response.json())


async def run(options: RunOptions, name: str, spec: InferenceServiceSpec, out: Path) -> dict[str, Any]:
    """The whole run; returns the report (also written to `out`). Raises RuntimeError or TimeoutError when the
    replicas do not start."""
    if options.demo:
        spec = demo_spec(spec, out)
    runtime = LocalRuntime(name, spec, out, threads_per_replica=options.threads_per_replica)
    interval = options.interval_s or runtime.policy.interval_s
    view = LiveView(name, runtime.policy, live=options.live and sys.stdout.isatty())
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)

    runtime.start()
    view.say(f"starting {len(runtime.daemons.replicas)} replica(s) of {name} "
             f"({spec.model.daemon_model}, {spec.engine.device}); logs in {runtime.daemons.log_dir}")
    load: LoadDriver | None = None
    demo: DemoRun | None = None
    try:
        await runtime.wait_ready(options.start_timeout_s, on_wait=view.waiting)
        view.say(f"ready after {runtime.elapsed():.0f}s (model loaded, profile measured)")
        if options.demo:
            profile = await fetch_profile(runtime)
            if spec.routing.mode == "slo-aware":
                router_url = await runtime.start_router(spec.routing.policy)
                view.say(f"router on {router_url} ({spec.routing.policy}): the load goes through it")
                load = LoadDriver(lambda: [router_url] if runtime.router.has_ready_replica() else [],
                                  spec.model.served_name, prompt_builder(spec))
            else:
                load = LoadDriver(runtime.ready_urls, spec.model.served_name, prompt_builder(spec))
            demo = DemoRun(runtime, view, profile, spec.engine.ceilings.max_token_budget,
                           spec.model.max_model_len or 2048, options.phase_scale, load, stop)
            await demo.start()
        if options.duration_s:
            run_for = options.duration_s
        else:
            run_for = demo.duration_s + 30 if demo else float("inf")
        deadline = time.monotonic() + run_for
        while not stop.is_set() and time.monotonic() < deadline:
            result = await runtime.step()
            view.step(result, runtime)
            if demo is not None and demo.done():
                break
            try:
                await asyncio.wait_for(stop.wait(), timeout=interval)
            except asyncio.TimeoutError:
                pass
    finally:
        stop.set()
        await drain(runtime, load, demo.task() if demo else None, view, float(spec.engine.drain_timeout_seconds))
        view.close()
    return report(name, spec, runtime, load, demo, out)
