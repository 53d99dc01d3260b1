"""`stallfree up -f FILE`: one InferenceService run locally, closed loop, no cluster and no GPU needed.

The daemons run as loopback processes, the operator's own control loop (the same tuner and scaler as
in the cluster) observes and acts on them, and with --demo a built-in load first breaches the TPOT SLO
(long prompts at a budget far too large for this CPU) and then exceeds one replica's prefill
capacity, so the budget is re-tuned and a replica added. Ctrl-C drains and stops everything; the run
ends with a short report, a JSON timeline and PNG plots.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

from stallfree.contracts import Profile
from stallfree.bench.serve import PromptBuilder
from stallfree.operator.local.load import LoadDriver, LoadPhase
from stallfree.operator.local.runtime import LocalRuntime
from stallfree.operator.local.view import LiveView
from stallfree.operator.api.spec import InferenceServiceSpec, parse_spec, spec_errors


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="stallfree up", description=__doc__.splitlines()[0])
    p.add_argument("-f", "--filename", required=True, help="an InferenceService manifest (YAML)")
    p.add_argument("--demo", action="store_true",
                   help="built-in load: a TPOT breach, then demand beyond one replica's prefill capacity")
    p.add_argument("--duration", type=float, default=None,
                   help="stop after this many seconds (default: the demo's length, else until Ctrl-C)")
    p.add_argument("--out", default=None, help="folder for the report, timeline and plots (default runs/up-<time>)")
    p.add_argument("--threads-per-replica", type=int, default=1, help="torch threads of each daemon process")
    p.add_argument("--start-timeout", type=float, default=600.0, help="seconds to wait for replicas to be ready")
    p.add_argument("--interval", type=float, default=None, help="control interval (default: the spec's)")
    p.add_argument("--no-live", action="store_true", help="print one line per control step instead of a live view")
    p.add_argument("--phase-scale", type=float, default=1.0, help="stretch (>1) or shrink (<1) the demo's load phases")
    return p


def load_manifest(path: str) -> tuple[str, InferenceServiceSpec]:
    """The first InferenceService in the file, validated as the operator validates it."""
    from stallfree.operator.api.checks import problems

    try:
        documents = [d for d in yaml.safe_load_all(Path(path).read_text()) if d]
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ValueError(f"{path} is not valid YAML: {exc}") from None
    found = [d for d in documents if isinstance(d, dict) and d.get("kind") == "InferenceService"]
    if not found:
        raise ValueError(f"{path} holds no InferenceService")
    manifest = found[0]
    name = (manifest.get("metadata") or {}).get("name") or "inferenceservice"
    try:
        spec = parse_spec(manifest.get("spec"))
    except Exception as exc:  # pydantic.ValidationError: every problem, one per line
        raise ValueError(f"{path}: invalid InferenceService spec:\n{spec_errors(exc)}") from None
    issues = problems(spec)
    if issues:
        raise ValueError(f"{path}: InferenceService {name} cannot be served: " + "; ".join(issues))
    return name, spec


def demo_load(profile: Profile, tpot_slo_ms: float, long_prompt: int, scale: float = 1.0
              ) -> tuple[LoadPhase, list[LoadPhase]]:
    """Chat traffic throughout, and long-prompt phases sized from the replica's own measured profile,
    so the demo means the same on any machine.

    One replica's prefill capacity is what its TPOT-limited budget pushes through per second. The
    long-prompt phase stays under it (only the budget is wrong); the next phase asks for well over it,
    which no budget can serve: a second replica is needed.
    """
    budget = profile.budget_for(tpot_slo_ms * 0.8)
    prefill_tokens_per_s = budget / (profile.iteration_ms_at(budget) / 1000.0)
    long_rate = prefill_tokens_per_s / long_prompt  # long prompts per second one replica can prefill
    phases = [
        LoadPhase("chat only", 20 * scale, 0.0, long_prompt, 24),
        LoadPhase("long prompts", 100 * scale, 0.45 * long_rate, long_prompt, 24),
        LoadPhase("beyond one replica", 120 * scale, 1.2 * long_rate, long_prompt, 24),
        LoadPhase("cool-down", 20 * scale, 0.0, long_prompt, 24),
    ]
    # Enough short requests that every stats window holds TPOT samples (the loop refuses to decide on
    # fewer), at a small share of the prefill capacity.
    chat_rate = max(0.6, min(0.1 * prefill_tokens_per_s / 64, 20.0))
    chat = LoadPhase("chat", sum(p.duration_s for p in phases), chat_rate, 64, 24)
    return chat, phases


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
    load_task: asyncio.Future | None = None
    phases: list[LoadPhase] = []
    try:
        await runtime.wait_ready(args.start_timeout, on_wait=view.waiting)
        view.say(f"ready after {runtime.elapsed():.0f}s (model loaded, profile measured)")
        if args.demo:
            profile = await fetch_profile(runtime)
            # Long enough that the starting budget takes each one in a single stalling iteration.
            long_prompt = min(spec.engine.ceilings.max_token_budget - 64, (spec.model.max_model_len or 2048) - 64)
            chat, phases = demo_load(profile, spec.slos.tpot_p99_ms, long_prompt, scale=args.phase_scale)
            if spec.routing.mode == "slo-aware":
                router_url = await runtime.start_router(spec.routing.policy)
                view.say(f"router on {router_url} ({spec.routing.policy}): the load goes through it")
                load = LoadDriver(lambda: [router_url] if runtime.router.has_ready_replica() else [],
                                  spec.model.served_name, prompt_builder(spec))
            else:
                load = LoadDriver(runtime.ready_urls, spec.model.served_name, prompt_builder(spec))
            load_task = asyncio.gather(load.run([chat], runtime.started, stop=stop),
                                       load.run(phases, runtime.started, on_phase=view.phase, stop=stop))
        if args.duration:
            run_for = args.duration
        else:
            run_for = sum(p.duration_s for p in phases) + 30 if phases else float("inf")
        deadline = time.monotonic() + run_for
        while not stop.is_set() and time.monotonic() < deadline:
            result = await runtime.step()
            view.step(result, runtime)
            if load_task is not None and load_task.done():
                break
            try:
                await asyncio.wait_for(stop.wait(), timeout=interval)
            except asyncio.TimeoutError:
                pass
    finally:
        stop.set()
        view.say("draining: in-flight requests finish, then the daemons stop")
        if load_task is not None:
            await asyncio.gather(load_task, return_exceptions=True)
        await runtime.close()
        view.close()
    return report(name, spec, runtime, load, phases, out)


def report(name: str, spec: InferenceServiceSpec, runtime: LocalRuntime, load: LoadDriver | None,
           phases: list[LoadPhase], out: Path) -> dict[str, Any]:
    from stallfree.operator.control.timeline import step_row

    rows = []
    for step in runtime.steps:
        row = step_row(step)
        row["t"] = round(step.time - runtime.started, 1)
        rows.append(row)
    starts = load.phase_starts if load else []
    result = {
        "scenario": "up --demo" if load else "up",
        "title": f"stallfree up -f {name}" + (" --demo" if load else ""),
        "time_label": "wall time since start (s)",
        "service": name,
        "model": spec.model.daemon_model,
        "hardware": spec.engine.device,
        "slo": {"ttft_p99_ms": spec.slos.ttft_p99_ms, "tpot_p99_ms": spec.slos.tpot_p99_ms,
                "queue_wait_p99_ms": spec.slos.queue_wait_p99_ms},
        "load": [dict(p.to_dict(), start_s=round(t, 1)) for t, p in starts],
        "timeline": rows,
        "events": [e.__dict__ for e in runtime.events],
        "client": load.summary() if load else {},
        "restarts": runtime.daemons.total_restarts,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(result, indent=1, default=str))
    if rows:
        from stallfree.simulator.closed_loop_plot import plot_timeline

        plot_timeline(result, str(out / "timeline.png"))
    return result


def summary_text(result: dict[str, Any], out: Path) -> str:
    rows = result["timeline"]
    budgets = [d.get("token_budget") for r in rows for d in r["replica_detail"] if d.get("token_budget")]
    lines = ["", f"== stallfree up: {result['service']} ({result['model']} on {result['hardware']}) =="]
    if budgets:
        lines.append(f"token budget: started {budgets[0]}, ended {budgets[-1]} "
                     f"(min {min(budgets)}, max {max(budgets)})")
    if rows:
        lines.append(f"replicas: started {rows[0]['replicas']}, max {max(r['desired_replicas'] for r in rows)}, "
                     f"ended {rows[-1]['desired_replicas']}")
    kinds: dict[str, int] = {}
    for e in result["events"]:
        kinds[e["reason"]] = kinds.get(e["reason"], 0) + 1
    if kinds:
        lines.append("events: " + ", ".join(f"{k} x{v}" for k, v in kinds.items()))
    slo = result["slo"]
    for label, s in result["client"].items():
        if label == "all":
            continue
        lines.append(f"  {label:<20} {s['completed']}/{s['requests']} done  client p99 TTFT {_ms(s['ttft_ms'])} "
                     f"TPOT {_ms(s['tpot_ms'])} (SLO {slo['tpot_p99_ms']:.0f})")
    if result["client"]:
        total = result["client"]["all"]
        lines.append(f"requests: {total['requests']} sent, {total['completed']} completed, {total['failed']} failed"
                     + (f" ({total['errors']})" if total["errors"] else ""))
    lines.append(f"report: {out / 'report.json'}   plots: {out / 'timeline.png'}")
    return "\n".join(lines)


def _ms(summary: dict[str, Any]) -> str:
    value = summary.get("p99")
    return "-" if value is None else f"{value:.0f} ms"


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    try:
        name, spec = load_manifest(args.filename)
    except ValueError as exc:
        print(f"stallfree up: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out or f"runs/up-{time.strftime('%Y%m%d-%H%M%S')}")
    try:
        result = asyncio.run(run(args, name, spec, out))
    except (RuntimeError, TimeoutError, httpx.HTTPError) as exc:
        print(f"stallfree up: {exc}", file=sys.stderr)
        return 1
    print(summary_text(result, out))
    return 0
