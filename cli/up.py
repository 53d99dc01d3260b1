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
import dataclasses
import json
import signal
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

from stallfree.contracts import Profile
from stallfree.loadgen.prompts import PromptBuilder
from stallfree.operator.local.demo_run import DemoRun
from stallfree.operator.local.load import LoadDriver, LoadPhase
from stallfree.operator.local.runtime import LocalRuntime
from stallfree.operator.local.view import LiveView
from stallfree.operator.api.spec import InferenceServiceSpec, parse_spec, spec_errors
from stallfree.operator.local.verdict import Phase, judge, verdict_text


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


async def drain(runtime: LocalRuntime, load: LoadDriver | None, load_task: asyncio.Future | None, view: LiveView,
                timeout_s: float) -> None:
    """Stop sending, let in-flight requests finish for at most the spec's drainTimeoutSeconds, then stop the
    daemons; a progress line every few seconds, so a drain is never silent. The daemons keep serving while
    the load winds down (draining them first would make the router retry what they hold elsewhere)."""
    started = time.monotonic()
    view.say(f"draining: {load.in_flight if load else 0} request(s) in flight, up to {timeout_s:.0f}s "
             "(the spec's drainTimeoutSeconds)")
    if load_task is not None:
        while not load_task.done() and time.monotonic() - started < timeout_s:
            await asyncio.wait([load_task], timeout=min(5.0, max(0.1, timeout_s - (time.monotonic() - started))))
            if not load_task.done():
                view.say(f"draining: {load.in_flight if load else 0} request(s) still in flight "
                         f"({time.monotonic() - started:.0f}s of {timeout_s:.0f}s)")
        if not load_task.done():
            load_task.cancel()
            view.say(f"drain timeout: {load.in_flight if load else 0} request(s) cancelled")
        await asyncio.gather(load_task, return_exceptions=True)
    view.say("stopping the daemons")
    await runtime.close()
    view.say(f"stopped after a {time.monotonic() - started:.0f}s drain")


def report(name: str, spec: InferenceServiceSpec, runtime: LocalRuntime, load: LoadDriver | None,
           demo: DemoRun | None, out: Path) -> dict[str, Any]:
    from stallfree.operator.control.timeline import step_row

    rows = []
    for step in runtime.steps:
        row = step_row(step)
        row["t"] = round(step.time - runtime.started, 1)
        row["infeasible"] = judged_infeasible(step)
        rows.append(row)
    starts = load.phase_starts if load else []
    phases = demo.phases if demo else []
    background = demo.background if demo else []
    slo = runtime.policy.slo
    result = {
        "scenario": "up --demo" if load else "up",
        "title": f"stallfree up -f {name}" + (" --demo" if load else ""),
        "time_label": "wall time since start (s)",
        "service": name,
        "model": spec.model.daemon_model,
        "hardware": spec.engine.device,
        "slo": {"ttft_p99_ms": slo.ttft_p99_ms, "tpot_p99_ms": slo.tpot_p99_ms,
                "queue_wait_p99_ms": slo.queue_wait_p99_ms},
        "load": [dict(p.to_dict(), start_s=round(t, 1)) for t, p in starts if p not in background],
        "background_load": [dict(p.to_dict(), start_s=round(t, 1)) for t, p in starts if p in background],
        "timeline": rows,
        "events": [e.__dict__ for e in runtime.events],
        "client": load.summary() if load else {},
        "restarts": runtime.daemons.total_restarts,
    }
    if demo is not None:
        cal = demo.calibration
        result["calibration"] = None if cal is None else {"factor": cal.factor, "windows": cal.windows,
                                                          "spread": list(cal.spread),
                                                          "long_prompt_factor": cal.long_prompt_factor,
                                                          "message": cal.describe()}
    if load and phases:
        result["verdict"] = demo_verdict(rows, starts, phases, runtime)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(result, indent=1, default=str))
    if rows:
        from stallfree.simulator.closed_loop_plot import plot_timeline

        plot_timeline(result, str(out / "timeline.png"))
    return result


def demo_verdict(rows: list[dict[str, Any]], starts: list[tuple[float, LoadPhase]], phases: list[LoadPhase],
                 runtime: LocalRuntime) -> dict[str, Any]:
    """Per phase: which SLO breached and how many control intervals until it was back under."""
    timed = [(t, p) for t, p in starts if p in phases]
    windows = [Phase(p.label, t, timed[i + 1][0] if i + 1 < len(timed) else float("inf"))
               for i, (t, p) in enumerate(timed)]
    slo = runtime.policy.slo
    verdict = judge(rows, windows, {"tpot": slo.tpot_p99_ms, "ttft": slo.ttft_p99_ms,
                                    "queue_wait": slo.queue_wait_p99_ms},
                    infeasible=infeasible_slos(runtime))
    return {"ok": verdict.ok, "failed": len(verdict.failed), "met_at_end": verdict.met_at_end,
            "lines": verdict_text(verdict, runtime.policy.interval_s),
            "phases": [dataclasses.asdict(p) for p in verdict.phases]}


VERDICT_NAMES = {"tpot": "tpot", "queueWait": "queue_wait", "ttft": "ttft"}


def judged_infeasible(step: Any) -> list[str] | None:
    """The SLOs this control step judged infeasible from the profile (verdict names); None: it could not judge."""
    feasibility = getattr(step, "feasibility", None)
    if feasibility is None or not feasibility.known:
        return None
    return [VERDICT_NAMES.get(slo, slo) for slo in feasibility.infeasible]


def infeasible_slos(runtime: LocalRuntime) -> dict[str, str]:
    """SLO -> the loop's latest message where it judged that SLO infeasible during the run (SLOFeasible=False)."""
    found: dict[str, str] = {}
    for step in runtime.steps:
        for slo in judged_infeasible(step) or ():
            found[slo] = step.feasibility.message
    return found


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
    if "verdict" in result:
        lines += result["verdict"]["lines"]
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
    # The demo fails when the loop left an SLO it judged feasible unrestored.
    return 0 if result.get("verdict", {}).get("ok", True) else 1
