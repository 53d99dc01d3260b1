"""One `stallfree up` run: start the daemons, wait until ready, then control intervals (and, with the demo, its
load) until the run's end or a stop signal; then drain and report."""
from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import time
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


async def run(args: argparse.Namespace, name: str, spec: InferenceServiceSpec, out: Path) -> dict[str, Any]:
    if args.demo:
        # A budget configured far above what the TPOT SLO allows on this hardware: the daemons start
        # there and the tuner must find the way down from feedback (not from the profile).
        engine = spec.engine
        budget = engine.token_budget.model_copy(update={"initial": engine.ceilings.max_token_budget})
        spec = spec.model_copy(update={"engine": engine.model_copy(update={"token_budget": budget})})
        recorded = out / "control-state.json"
        if recorded.exists():  # a demo is a script from the spec's start, never a resumed run
            recorded.unlink()
            print(f"demo: starting from the spec, not from the control state an earlier run left in {out}", flush=True)
    runtime = LocalRuntime(name, spec, out, threads_per_replica=args.threads_per_replica)
    interval = args.interval or runtime.policy.interval_s
    view = LiveView(name, runtime.policy, live=not args.no_live and sys.stdout.isatty())
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
        await runtime.wait_ready(args.start_timeout, on_wait=view.waiting)
        view.say(f"ready after {runtime.elapsed():.0f}s (model loaded, profile measured)")
        if args.demo:
            profile = await fetch_profile(runtime)
            if spec.routing.mode == "slo-aware":
                router_url = await runtime.start_router(spec.routing.policy)
                view.say(f"router on {router_url} ({spec.routing.policy}): the load goes through it")
                load = LoadDriver(lambda: [router_url] if runtime.router.has_ready_replica() else [],
                                  spec.model.served_name, prompt_builder(spec))
            else:
                load = LoadDriver(runtime.ready_urls, spec.model.served_name, prompt_builder(spec))
            demo = DemoRun(runtime, view, profile, spec.engine.ceilings.max_token_budget,
                           spec.model.max_model_len or 2048, args.phase_scale, load, stop)
            await demo.start()
        if args.duration:
            run_for = args.duration
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
