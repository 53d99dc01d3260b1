"""`stallfree bench router --objectives`: two objectives through the real `stallfree router`, sim daemons behind it.

The router runs with `--objectives`: `interactive` (priority 10, the default) and `batch` (priority -1: sheddable,
a looser TTFT target). Two phases, each on fresh daemons and a fresh router (no phase inherits another's queues
or prefix cache; `--quick` shares the daemons), replaying one seeded interactive workload:

- alone: the interactive stream only, at --interactive-load of the daemons' combined prefill capacity;
- flood: the same interactive stream, and beside it a batch stream (`x-stallfree-objective: batch`) of long
  prompts asking --flood times that capacity.

What the router should deliver, and what is judged (exit 1 on a miss): nothing lost (every request gets an
answer or a clean refusal); every interactive request served (it is not sheddable: it waits); every batch request
served or refused at arrival (429 shed_predicted_miss with Retry-After, or queue_full), none failing after it
waited; and the interactive p99 TTFT with the flood within --flood-bound (1.5x) of its p99 alone. Why that bound:
the interactive band is served strictly before batch in the router's queue, so no interactive request waits
behind a batch one there, nor in the engine's (a batch prefill gets no chunk beside an interactive one); what the
flood can still cost it is the batch iteration already under way when it arrives and the batch decodes that share
its iterations. Goodput per objective (the share of its requests served within its TTFT target; a shed
request counts as not met, and not as lost) is printed beside it.

Each stream is a tenant of its own, authenticated as production's clients are: the router runs with
`--api-keys-file` (two keys, hashed: `interactive-team` may use only `interactive`, `batch-team` only `batch`) and
every request carries its tenant's `Authorization: Bearer` key beside the objective it names.
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import random
import secrets
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

from stallfree.arrivals import arrival_times
from stallfree.loadgen.outcome import REFUSED_AT_ARRIVAL, SERVED, met, outcome, shed
from stallfree.loadgen.stream import RequestResult
from stallfree.operator.router.objectives import OBJECTIVE_HEADER

INTERACTIVE, BATCH = "interactive", "batch"
FLEET = (("h100", 2),)
TICK_S = 10.0


@dataclass
class ObjectivesConfig:
    duration_s: float = 25.0  # seconds of arrivals per phase
    interactive_load: float = 0.6  # interactive prefill demand over the combined prefill capacity
    flood: float = 3.0  # batch prefill demand over the same capacity
    interactive_ttft_ms: float = 1000.0
    batch_ttft_ms: float = 4000.0
    flood_bound: float = 1.5  # interactive p99 TTFT with the flood over without, at most
    queue_wait_slo_ms: float = 800.0  # the router's dispatch wait is a quarter of it
    queue_timeout_s: float = 30.0  # the router's: a request waiting longer is a 503 (a failure after waiting)
    token_budget: int = 512
    profile_s: float = 3.0
    seed: int = 0
    fresh_daemons: bool = True  # False (--quick): one set of daemons for both phases, a fresh router each

    def objectives(self) -> list[dict[str, Any]]:
        """The router's --objectives (operator/router/objectives.py parse_objectives)."""
        return [{"name": INTERACTIVE, "priority": 10, "ttftP99Ms": self.interactive_ttft_ms, "default": True},
                {"name": BATCH, "priority": -1, "ttftP99Ms": self.batch_ttft_ms}]


# ---- workloads ---------------------------------------------------------------------------------


def workload(rate: float, duration_s: float, seed: int, prompt: tuple[int, int], output: tuple[int, int]):
    """Poisson arrivals at `rate`, uniform prompt and output lengths (inclusive bounds)."""
    from stallfree.simulator.workload import RequestSpec

    rng = random.Random(seed)
    return [RequestSpec(at, rng.randint(*prompt), rng.randint(*output))
            for at in arrival_times(rate, rng, end=duration_s, first_at_start=True)]


INTERACTIVE_PROMPT, INTERACTIVE_OUTPUT = (128, 384), (8, 24)
BATCH_PROMPT, BATCH_OUTPUT = (2000, 4000), (8, 16)


def mean(bounds: tuple[int, int]) -> float:
    return sum(bounds) / 2


# ---- judging (pure) ------------------------------------------------------------------------------


def tally(results: Sequence[RequestResult], ttft_target_ms: float) -> dict[str, Any]:
    """One objective's figures over its requests: counts per outcome, sheds, TTFT and goodput."""
    from stallfree.simulator.latency_summary import summarize

    kinds = [outcome(r) for r in results]
    served = [r for r in results if r.ok]
    sheds = [r for r in results if shed(r)]
    good = sum(met(r, ttft_target_ms) for r in served)
    return {"requests": len(results), "served": len(served), "shed": len(sheds),
            "shed_without_retry_after": sum(r.retry_after_s is None for r in sheds),
            "refused_at_arrival": kinds.count("refused_at_arrival"),
            "refused_after_waiting": kinds.count("refused_after_waiting"), "lost": kinds.count("lost"),
            "served_late": len(served) - good, "ttft_target_ms": ttft_target_ms,
            "goodput": good / len(results) if results else None,
            "ttft_ms": summarize(r.ttft_ms for r in served), "tpot_ms": summarize(r.tpot_ms for r in served
                                                                                 if r.tpot_ms is not None),
            "errors": _errors(results)}


def judge(alone: Sequence[RequestResult], flood_interactive: Sequence[RequestResult],
          flood_batch: Sequence[RequestResult], config: ObjectivesConfig) -> dict[str, Any]:
    """The figures of both phases and the goals, each (goal, met, figures)."""
    figures = {"alone": {INTERACTIVE: tally(alone, config.interactive_ttft_ms)},
               "flood": {INTERACTIVE: tally(flood_interactive, config.interactive_ttft_ms),
                         BATCH: tally(flood_batch, config.batch_ttft_ms)}}
    p99_alone = figures["alone"][INTERACTIVE]["ttft_ms"]["p99"]
    p99_flood = figures["flood"][INTERACTIVE]["ttft_ms"]["p99"]
    ratio = p99_flood / p99_alone if p99_alone and p99_flood is not None else None
    figures["interactive_p99_ttft_ratio"] = ratio
    lost = sum(t["lost"] for phase in ("alone", "flood") for t in figures[phase].values())
    interactive = [figures[phase][INTERACTIVE] for phase in ("alone", "flood")]
    batch = figures["flood"][BATCH]
    goals = [
        ("0 lost (every request answered or cleanly refused)", lost == 0, f"{lost} lost"),
        ("every interactive request served (not sheddable: it waits)",
         all(t["served"] == t["requests"] > 0 for t in interactive),
         " and ".join(f"{t['served']}/{t['requests']}" for t in interactive)),
        ("every batch request served or refused at arrival (none fails after waiting)",
         batch["requests"] > 0 and batch["refused_after_waiting"] == 0 and batch["lost"] == 0
         and batch["shed_without_retry_after"] == 0,
         f"{batch['served']} served, {batch['refused_at_arrival']} refused at arrival ({batch['shed']} shed, "
         f"{batch['shed_without_retry_after']} of them without Retry-After), "
         f"{batch['refused_after_waiting']} refused after waiting, {batch['lost']} lost"),
        (f"interactive p99 TTFT with the flood <= {config.flood_bound:g}x without",
         ratio is not None and ratio <= config.flood_bound,
         "-" if ratio is None else f"{p99_flood:,.0f} vs {p99_alone:,.0f} ms ({ratio:.2f}x)"),
    ]
    return {"figures": figures, "goals": [{"goal": g, "met": m, "figures": f} for g, m, f in goals]}


def _errors(results: Sequence[RequestResult]) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in results:
        if not r.ok:
            key = (r.error or "unknown")[:120]
            out[key] = out.get(key, 0) + 1
    return out


def table(payload: dict[str, Any]) -> list[str]:
    f = payload["figures"]
    lines = [f"{'phase':<7}{'objective':<13}{'sent':>6}{'served':>8}{'shed':>6}{'after wait':>11}{'lost':>6}"
             f"{'TTFT p50':>10}{'TTFT p99':>10}{'target':>9}{'goodput':>9}"]
    for phase in ("alone", "flood"):
        for name, t in f[phase].items():
            ttft = t["ttft_ms"]
            lines.append(f"{phase:<7}{name:<13}{t['requests']:>6}{t['served']:>8}{t['shed']:>6}"
                         f"{t['refused_after_waiting']:>11}{t['lost']:>6}{_ms(ttft['p50']):>10}{_ms(ttft['p99']):>10}"
                         f"{t['ttft_target_ms']:>7,.0f}ms{_pct(t['goodput']):>9}")
    ratio = f["interactive_p99_ttft_ratio"]
    lines.append("interactive p99 TTFT with the flood / without: " + ("-" if ratio is None else f"{ratio:.2f}x"))
    return lines


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}ms"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


# ---- the run -------------------------------------------------------------------------------------


@dataclass
class Stream:
    objective: str
    requests: list
    prompts: list[str]


def write_api_keys(folder: Path) -> tuple[Path, dict[str, str]]:
    """A fresh key per stream's tenant, its SHA-256 in the router's keys file: (the file, objective -> key)."""
    keys = {objective: secrets.token_urlsafe(24) for objective in (INTERACTIVE, BATCH)}
    entries = [{"sha256": hashlib.sha256(key.encode()).hexdigest(), "tenant": f"{objective}-team",
                "objectives": [objective]} for objective, key in keys.items()]
    path = folder / "api-keys.json"
    path.write_text(json.dumps({"keys": entries}))
    return path, keys


async def _run_phase(url: str, label: str, streams: list[Stream], model: str, config: ObjectivesConfig,
                     keys: dict[str, str], say) -> dict[str, list[RequestResult]]:
    """Every stream at once through the router, a progress line every TICK_S; results per objective."""
    from stallfree.loadgen.run import run_benchmark

    ended: dict[str, list[str]] = {s.objective: [] for s in streams}

    def seen(objective: str):
        return lambda r: ended[objective].append(outcome(r))

    limit_s = config.duration_s + config.queue_timeout_s + 15.0  # bounded: a request still open then is lost
    runs = [asyncio.ensure_future(run_benchmark(url, s.requests, s.prompts, model, timeout_s=limit_s,
                                                request_timeout_s=limit_s, api_key=keys[s.objective],
                                                headers={OBJECTIVE_HEADER: s.objective},
                                                on_result=seen(s.objective))) for s in streams]
    started = time.monotonic()
    while not all(r.done() for r in runs):
        await asyncio.wait(runs, timeout=TICK_S)
        counts = "; ".join(f"{o} {len(k)}/{len(s.requests)} ended ({k.count(SERVED)} served, "
                           f"{k.count(REFUSED_AT_ARRIVAL)} refused at arrival)"
                           for s in streams for o, k in [(s.objective, ended[s.objective])])
        say(f"[objectives] {label}: {time.monotonic() - started:.0f}s: {counts}")
    return {s.objective: r.result()[0] for s, r in zip(streams, runs)}


def run(config: ObjectivesConfig, log_dir: Path, say) -> dict[str, Any]:
    from stallfree.bench.router import MODEL, Fleet

    results: dict[str, dict[str, list[RequestResult]]] = {}
    out: dict[str, Any] = {"config": asdict(config), "objectives": config.objectives(),
                           "fleet": [{"hardware": hw, "replicas": n} for hw, n in FLEET]}
    fleet: Fleet | None = None
    plan: Plan | None = None
    keys_file, keys = write_api_keys(log_dir)
    try:
        for label in ("alone", "flood"):
            if fleet is None or config.fresh_daemons:
                if fleet is not None:
                    fleet.stop()
                fleet = Fleet(log_dir, 8192, config.token_budget, config.profile_s, fleet=FLEET)
                say(f"[objectives] {label}: starting {sum(n for _, n in FLEET)} sim daemons")
                fleet.start()
            if plan is None:
                plan = make_plan(config, [r.url for r in fleet.replicas], MODEL)
                out.update(plan.figures)
                say(plan.describe(config))
            fleet.start_router("slo-aware", plan.chars_per_token, router_flags(config, keys_file))
            streams = plan.streams(label)
            try:
                results[label] = asyncio.run(_run_phase(fleet.router_url, label, streams, MODEL, config, keys, say))
            finally:
                fleet.stop_router()
    finally:
        if fleet is not None:
            fleet.stop()
    out.update(judge(results["alone"][INTERACTIVE], results["flood"][INTERACTIVE], results["flood"][BATCH], config))
    return out


def router_flags(config: ObjectivesConfig, api_keys_file: Path) -> list[str]:
    return ["--objectives", json.dumps(config.objectives()), "--queue-wait-slo-ms", str(config.queue_wait_slo_ms),
            "--queue-timeout-s", str(config.queue_timeout_s), "--api-keys-file", str(api_keys_file)]


@dataclass
class Plan:
    interactive: list
    batch: list
    builder: Any  # PromptBuilder
    chars_per_token: float
    figures: dict[str, float]

    def streams(self, label: str) -> list[Stream]:
        """The phase's streams. Each phase's prompts are its own text (same lengths): daemons shared between
        phases give the flood's interactive prompts no prefix-cache hits from the alone phase."""
        offset = 0 if label == "alone" else 500_000
        out = [Stream(INTERACTIVE, self.interactive,
                      [self.builder.prompt(r, offset + i) for i, r in enumerate(self.interactive)])]
        if label == "flood":
            out.append(Stream(BATCH, self.batch, [self.builder.prompt(r, 1_000_000 + i) for i, r in enumerate(self.batch)]))
        return out

    def describe(self, config: ObjectivesConfig) -> str:
        f = self.figures
        return (f"[objectives] combined prefill capacity {f['capacity_tokens_per_s']:,.0f} tok/s: interactive "
                f"{len(self.interactive)} requests at {f['interactive_rate']:.1f}/s ({config.interactive_load:.0%}), "
                f"batch {len(self.batch)} at {f['batch_rate']:.1f}/s ({config.flood:g}x) in the flood")


def make_plan(config: ObjectivesConfig, replica_urls: list[str], model: str) -> Plan:
    """Both workloads, sized from the daemons' combined prefill capacity (as the router counts it)."""
    from stallfree.bench.router import prefill_capacity_tokens_per_s
    from stallfree.loadgen.prompts import PromptBuilder
    from stallfree.node_daemon.sim.backend import sim_tokenizer

    builder = PromptBuilder(sim_tokenizer(model))
    capacity = prefill_capacity_tokens_per_s(replica_urls)
    i_rate = config.interactive_load * capacity / mean(INTERACTIVE_PROMPT)
    b_rate = config.flood * capacity / mean(BATCH_PROMPT)
    interactive = workload(i_rate, config.duration_s, config.seed, INTERACTIVE_PROMPT, INTERACTIVE_OUTPUT)
    batch = workload(b_rate, config.duration_s, config.seed + 1, BATCH_PROMPT, BATCH_OUTPUT)
    sample = [builder.prompt(r, i) for i, r in enumerate(interactive + batch)]
    chars_per_token = sum(map(len, sample)) / max(1, sum(r.prompt_len for r in interactive + batch))
    return Plan(interactive, batch, builder, chars_per_token,
                {"capacity_tokens_per_s": capacity, "interactive_rate": i_rate, "batch_rate": b_rate})
