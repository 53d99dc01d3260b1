"""`stallfree bench router`: routing policies compared on one recorded workload through `stallfree router`.

Four sim daemons on loopback (two a100, two h100 of llama-3-70b: distinct profiles, the same token
budget) behind a router started once per policy; fresh daemons for every policy, so no policy inherits
another's queues or prefix cache. Two workloads, each generated once and replayed to every policy:

- load: ShareGPT-like prompts with 10% of them 4-8k tokens, Poisson arrivals at --load (0.8) of the
  four replicas' combined prefill capacity (read off their profiles at their live budget);
- affinity: 48 system prompts of 2k tokens (and a short question each), every replica's KV cache 32k
  tokens: more prefixes than one replica holds, fewer than four hold together.

Per policy: client-seen TTFT through the router; queue wait (arrival to first scheduled) from the
daemons' histograms, pooled; prefix-cache hit rate from the daemons' counters. `--itl` instead measures
what the router adds to inter-token latency at 64 streams (one daemon, direct vs through the router).
`--objectives` instead serves two objectives, interactive alone and beside a batch flood
(bench/router_objectives.py, whose docstring says what is judged and why).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from stallfree.arrivals import arrival_times
from stallfree.contracts import Profile, WindowStats
from stallfree.net import free_port
from stallfree.operator.router.rates import prefill_tokens_per_ms
from stallfree.ready import wait_until_ready

TOKEN = "bench-router"
MODEL = "llama-3-70b"
FLEET = (("a100", 2), ("h100", 2))
POLICIES = ("slo-aware", "least-outstanding", "round-robin", "random", "slo-aware-immediate")
# slo-aware-immediate: the slo-aware pick without the router's queue (every request dispatched at arrival).
ROUTER_RUN = {"slo-aware-immediate": ("slo-aware", ["--no-flow-control"])}


# The affinity workload asks about caches, not speeds: four equal replicas, so that where a prefix lives is
# the only difference between policies (the load workload's mixed fleet is where speed matters).
AFFINITY_FLEET = (("h100", 4),)


@dataclass(frozen=True)
class Setup:
    name: str
    num_kv_blocks: int  # of 16 tokens
    policies: tuple[str, ...]
    fleet: tuple[tuple[str, int], ...] = FLEET


def daemon_args(hardware: str, num_kv_blocks: int, budget: int, profile_s: float) -> list[str]:
    return ["--backend", "sim", "--model", MODEL, "--hardware", hardware, "--num-kv-blocks", str(num_kv_blocks),
            "--max-token-budget", "1024", "--max-num-seqs-ceiling", "64", "--max-num-seqs", "64",
            "--token-budget", str(budget), "--profile-max-seconds", str(profile_s), "--stats-window-s", "900",
            "--max-queue-requests", "0", "--log-level", "warning"]


def say(text: str) -> None:
    print(text, flush=True)


# ---- workloads ---------------------------------------------------------------------------------


def load_workload(rate: float, duration_s: float, seed: int, max_len: int = 8192):
    from stallfree.simulator.workload import WorkloadSpec, generate, parse_length

    spec = WorkloadSpec(rate=rate, prompt=parse_length("mix:0.9*sharegpt-prompt|0.1*uniform:4000:8000"),
                        output=parse_length("uniform:16:48"), num_requests=100_000, duration_s=duration_s,
                        max_total_len=max_len - 64, seed=seed)
    return generate(spec)


def affinity_workload(rate: float, duration_s: float, seed: int, groups: int = 48, prefix_tokens: int = 2048):
    from stallfree.simulator.workload import RequestSpec

    rng = random.Random(seed)
    out = []
    # One rng for the gaps and the shapes: the generator draws each gap after the request before it is made.
    for now in arrival_times(rate, rng, end=duration_s, first_at_start=True):
        suffix = rng.randint(32, 256)
        out.append(RequestSpec(now, prefix_tokens + suffix, rng.randint(16, 48), prefix_tokens, rng.randrange(groups)))
    return out


def mean_prompt(requests) -> float:
    return sum(r.prompt_len for r in requests) / max(1, len(requests))


# ---- processes ---------------------------------------------------------------------------------


class Fleet:
    """The four daemons (LocalDaemonSet per hardware) and, per policy, a router process in front."""

    def __init__(self, log_dir: Path, num_kv_blocks: int, budget: int, profile_s: float, fleet=FLEET) -> None:
        from stallfree.operator.local.daemons import LocalDaemonSet

        self.sets = [LocalDaemonSet(f"sim-{hw}", daemon_args(hw, num_kv_blocks, budget, profile_s), TOKEN,
                                    log_dir, drain_timeout_s=5.0) for hw, _ in fleet]
        self.counts = [n for _, n in fleet]
        self.log_dir = log_dir
        self.router: subprocess.Popen | None = None
        self.router_url = ""

    @property
    def replicas(self):
        return [r for s in self.sets for r in s.replicas]

    def start(self) -> None:
        for daemon_set, count in zip(self.sets, self.counts):
            daemon_set.scale_to(count)
        for daemon_set in self.sets:
            if not daemon_set.wait_ready(timeout_s=240):
                raise RuntimeError(f"daemons not ready; see {self.log_dir}")

    def start_router(self, policy: str, chars_per_token: float, extra: list[str] = ()) -> None:
        port = free_port()
        self.router_url = f"http://127.0.0.1:{port}"
        env = dict(os.environ, STALLFREE_ADMIN_TOKEN=TOKEN)
        log = open(self.log_dir / f"router-{policy}.log", "ab")
        self.router = subprocess.Popen(
            [sys.executable, "-m", "stallfree.cli", "router", "--replicas", ",".join(r.url for r in self.replicas),
             "--policy", policy, "--chars-per-token", str(chars_per_token), "--host", "127.0.0.1",
             "--port", str(port), "--log-level", "warning", *extra],
            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        log.close()
        wait_until_ready(self._router_sees_every_replica, 60.0, alive=lambda: self.router.poll() is None, poll_s=0.2,
                         what=f"the router (its log: {self.log_dir}/router-{policy}.log)")

    def _router_sees_every_replica(self) -> bool:
        try:
            body = httpx.get(self.router_url + "/ready", timeout=1).json()
        except (httpx.HTTPError, ValueError):
            return False
        return body.get("replicas_healthy") == len(self.replicas)

    def stop(self) -> None:
        self.stop_router()
        for daemon_set in self.sets:
            daemon_set.shutdown()

    def stop_router(self) -> None:
        if self.router is not None:
            self.router.terminate()
            try:
                self.router.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.router.kill()
                self.router.wait()
            self.router = None


def admin_get(url: str, path: str) -> Any:
    return httpx.get(url + path, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30).json()


def prefill_capacity_tokens_per_s(replica_urls: list[str]) -> float:
    """Sum over replicas of what the router counts each one to prefill (operator/router/rates.py)."""
    total = 0.0
    for url in replica_urls:
        profile = Profile.from_dict(admin_get(url, "/admin/profile"))
        stats = WindowStats.from_dict(admin_get(url, "/admin/stats"))
        total += prefill_tokens_per_ms(profile, stats) * 1000.0
    return total


# ---- daemon-side figures -----------------------------------------------------------------------


def scrape(url: str) -> dict[str, float]:
    """name{labels} -> value of the daemon's /metrics (counters and histogram buckets we read)."""
    out: dict[str, float] = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(("stallfree_prefix_cache_", "stallfree_request_queue_time_seconds_bucket",
                            "stallfree_preemptions")):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


def bucket_quantile(buckets: dict[float, float], q: float) -> float | None:
    """Prometheus-style histogram_quantile over cumulative buckets (upper bound -> count), in ms."""
    edges = sorted(buckets)
    total = buckets[edges[-1]] if edges else 0
    if not total:
        return None
    rank = q * total
    lo_edge, lo_count = 0.0, 0.0
    for edge in edges:
        count = buckets[edge]
        if count >= rank:
            if edge == float("inf"):
                return lo_edge * 1000.0
            frac = (rank - lo_count) / max(1e-12, count - lo_count)
            return (lo_edge + frac * (edge - lo_edge)) * 1000.0
        lo_edge, lo_count = edge, count
    return lo_edge * 1000.0


def daemon_figures(before: list[dict[str, float]], after: list[dict[str, float]]) -> dict[str, Any]:
    hits = queries = preemptions = 0.0
    pooled: dict[float, float] = {}
    for b, a in zip(before, after):
        for key, value in a.items():
            delta = value - b.get(key, 0.0)
            if key.startswith("stallfree_prefix_cache_hits"):
                hits += delta
            elif key.startswith("stallfree_prefix_cache_queries"):
                queries += delta
            elif key.startswith("stallfree_preemptions"):
                preemptions += delta
            elif "queue_time_seconds_bucket" in key:
                le = key.split('le="', 1)[1].split('"', 1)[0]
                edge = float("inf") if le == "+Inf" else float(le)
                pooled[edge] = pooled.get(edge, 0.0) + delta
    return {"prefix_cache_hit_rate": hits / queries if queries else None, "prefix_cache_hit_tokens": hits,
            "prompt_tokens_looked_up": queries, "preemptions": preemptions,
            "queue_wait_ms_p50": bucket_quantile(pooled, 0.50), "queue_wait_ms_p99": bucket_quantile(pooled, 0.99)}


def router_picks(url: str) -> dict[str, float]:
    picks: dict[str, float] = {}
    admin = {"Authorization": f"Bearer {TOKEN}"}  # the replica label is shown to the admin token only
    for line in httpx.get(url + "/metrics", timeout=10, headers=admin).text.splitlines():
        if line.startswith("stallfree_router_picks_total{"):
            replica = line.split('replica="', 1)[1].split('"', 1)[0]
            picks[replica] = picks.get(replica, 0.0) + float(line.rpartition(" ")[2])
    return picks


# ---- one policy ----------------------------------------------------------------------------------


def run_policy(fleet: Fleet, policy: str, requests, prompts: list[str], chars_per_token: float,
               timeout_s: float) -> dict[str, Any]:
    from stallfree.loadgen.run import run_benchmark, summarize_results
    from stallfree.simulator.latency_summary import SLOs

    router_policy, extra = ROUTER_RUN.get(policy, (policy, []))
    fleet.start_router(router_policy, chars_per_token, extra)
    urls = [r.url for r in fleet.replicas]
    names = {r.url.split("://", 1)[1]: r.name for r in fleet.replicas}
    before = [scrape(u) for u in urls]
    results, wall_s = asyncio.run(run_benchmark(fleet.router_url, requests, prompts, MODEL, timeout_s=timeout_s,
                                                request_timeout_s=timeout_s, progress=False))
    after = [scrape(u) for u in urls]
    summary = summarize_results(results, wall_s, SLOs())
    picks = {names.get(k, k): v for k, v in router_picks(fleet.router_url).items()}
    figures = daemon_figures(before, after)
    return {"policy": policy, "summary": summary, "daemons": figures, "picks": picks,
            "ttft_ms": [r.ttft_ms for r in results if r.ok]}


def run_setup(setup: Setup, args: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    from stallfree.loadgen.prompts import PromptBuilder
    from stallfree.node_daemon.sim.backend import sim_tokenizer

    builder = PromptBuilder(sim_tokenizer(MODEL))
    chars_per_token = None
    requests: list = []
    prompts: list[str] = []
    out: dict[str, Any] = {"workload": setup.name, "policies": {},
                           "fleet": [{"hardware": hw, "replicas": n} for hw, n in setup.fleet]}
    for policy in setup.policies:
        fleet = Fleet(log_dir, setup.num_kv_blocks, args.token_budget, args.profile_seconds, fleet=setup.fleet)
        say(f"[{setup.name}] {policy}: starting 4 sim daemons ({', '.join(f'{n}x {hw}' for hw, n in setup.fleet)})")
        try:
            fleet.start()
            if not requests:
                capacity = prefill_capacity_tokens_per_s([r.url for r in fleet.replicas])
                probe = (load_workload if setup.name == "load" else affinity_workload)(1.0, 200.0, args.seed)
                rate = args.load * capacity / mean_prompt(probe)
                make = load_workload if setup.name == "load" else affinity_workload
                requests = make(rate, args.duration_s, args.seed)
                say(f"[{setup.name}] combined prefill capacity {capacity:,.0f} tok/s; {len(requests)} requests at "
                    f"{rate:.2f} req/s (mean prompt {mean_prompt(requests):,.0f} tokens) = {args.load:.0%} of it")
                prompts = [builder.prompt(r, i) for i, r in enumerate(requests)]
                tokens = sum(r.prompt_len for r in requests)
                chars_per_token = sum(map(len, prompts)) / max(1, tokens)
                out.update(capacity_tokens_per_s=capacity, rate=rate, num_requests=len(requests),
                           mean_prompt_tokens=mean_prompt(requests), chars_per_token=chars_per_token)
            started = time.monotonic()
            result = run_policy(fleet, policy, requests, prompts, chars_per_token, args.duration_s * 4 + 60)
            s, d = result["summary"], result["daemons"]
            say(f"[{setup.name}] {policy}: {s['completed']}/{s['num_requests']} done in {time.monotonic() - started:.0f}s;"
                f" TTFT p50 {_ms(s['ttft_ms']['p50'])} p99 {_ms(s['ttft_ms']['p99'])}; queue wait p99 "
                f"{_ms(d['queue_wait_ms_p99'])}; prefix hit {_pct(d['prefix_cache_hit_rate'])}")
            out["policies"][policy] = result
        finally:
            fleet.stop()
    return out


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f} ms" if value >= 100 else f"{value:.1f} ms"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def table(result: dict[str, Any]) -> list[str]:
    lines = [f"{'policy':<20}{'done':>9}{'TTFT p50':>11}{'TTFT p99':>11}{'queue p50':>11}{'queue p99':>11}"
             f"{'prefix hit':>12}  picks per replica"]
    for policy, r in result["policies"].items():
        s, d = r["summary"], r["daemons"]
        picks = " ".join(f"{int(v)}" for _, v in sorted(r["picks"].items()))
        lines.append(f"{policy:<20}{s['completed']:>4}/{s['num_requests']:<4}{_ms(s['ttft_ms']['p50']):>11}"
                     f"{_ms(s['ttft_ms']['p99']):>11}{_ms(d['queue_wait_ms_p50']):>11}{_ms(d['queue_wait_ms_p99']):>11}"
                     f"{_pct(d['prefix_cache_hit_rate']):>12}  {picks}")
    return lines


def goals(load: dict | None, affinity: dict | None) -> list[tuple[str, bool | None, str]]:
    """(goal, met, figures) for each goal of the routing issue whose policies ran."""
    out = []

    def fig(res, policy, key):
        r = res["policies"].get(policy)
        if r is None:
            return None
        return {"ttft_p99": r["summary"]["ttft_ms"]["p99"], "ttft_p50": r["summary"]["ttft_ms"]["p50"],
                "queue_p99": r["daemons"]["queue_wait_ms_p99"], "hit": r["daemons"]["prefix_cache_hit_rate"]}[key]

    if load:
        for key, name in (("ttft_p99", "p99 TTFT"), ("queue_p99", "p99 queue wait")):
            slo, rr, lo = fig(load, "slo-aware", key), fig(load, "round-robin", key), fig(load, "least-outstanding", key)
            if slo is not None and rr:
                out.append((f"load: {name} >= 30% lower than round-robin", slo <= 0.7 * rr,
                            f"{slo:,.0f} vs {rr:,.0f} ms ({1 - slo / rr:.0%} lower)"))
            if slo is not None and lo is not None:
                out.append((f"load: {name} not worse than least-outstanding", slo <= lo * 1.02 + 1,
                            f"{slo:,.0f} vs {lo:,.0f} ms"))
        for key, name in (("ttft_p99", "p99 TTFT"), ("queue_p99", "p99 queue wait")):
            queued, now = fig(load, "slo-aware", key), fig(load, "slo-aware-immediate", key)
            if queued is not None and now is not None:
                out.append((f"load: {name} with the router's queue not worse than immediate dispatch",
                            queued <= now * 1.02 + 1, f"{queued:,.0f} vs {now:,.0f} ms"))
    if affinity:
        slo, rr = fig(affinity, "slo-aware", "hit"), fig(affinity, "round-robin", "hit")
        if slo is not None and rr is not None:
            out.append(("affinity: prefix-cache hit rate >= 2x round-robin's", slo >= 2 * rr,
                        f"{slo:.1%} vs {rr:.1%} ({slo / max(rr, 1e-9):.1f}x)"))
        slo, rr = fig(affinity, "slo-aware", "ttft_p50"), fig(affinity, "round-robin", "ttft_p50")
        if slo is not None and rr is not None:
            out.append(("affinity: p50 TTFT lower than round-robin", slo < rr, f"{slo:,.0f} vs {rr:,.0f} ms"))
    return out


def plot(results: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4.5), squeeze=False)
    for ax, result in zip(axes[0], results):
        for policy, r in result["policies"].items():
            values = sorted(r["ttft_ms"])
            if values:
                ax.plot(values, [(i + 1) / len(values) for i in range(len(values))], label=policy)
        ax.set_xscale("log")
        ax.set_xlabel("TTFT through the router (ms, log)")
        ax.set_ylabel("share of requests")
        ax.set_title(f"{result['workload']} workload")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---- ITL: what the router adds -------------------------------------------------------------------


def run_itl(args: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    from stallfree.bench.itl import _percentiles, _run_load
    from stallfree.operator.local.daemons import LocalDaemonSet

    daemons = LocalDaemonSet("itl", ["--backend", "sim", "--model", "llama-3-8b", "--hardware", "h100",
                                     "--profile-max-seconds", "5", "--log-level", "warning"], TOKEN, log_dir,
                             drain_timeout_s=5.0)
    fleet = Fleet(log_dir, 0, 0, 0, fleet=())
    fleet.sets = [daemons]
    out: dict[str, Any] = {"streams": args.itl_streams, "max_tokens": args.itl_tokens, "runs": []}
    try:
        daemons.scale_to(1)
        if not daemons.wait_ready(timeout_s=120):
            raise RuntimeError("the ITL daemon never got ready")
        fleet.start_router("slo-aware", 1.0)
        direct = daemons.replicas[0].url
        # Alternate direct and routed runs so drift on a shared machine hits both alike.
        for label, url in (("direct", direct), ("router", fleet.router_url)) * args.itl_rounds:
            results = asyncio.run(_run_load(url, "llama-3-8b", args.itl_streams, 1, 64, args.itl_tokens, 250))
            itl = [(r["arrivals"][i] - r["arrivals"][i - 1]) * 1000.0 for r in results
                   for i in range(1, len(r["arrivals"])) if r["tokens"][i] - r["tokens"][i - 1] == 1]
            row = {"path": label, "itl_ms": _percentiles(itl)}
            out["runs"].append(row)
            say(f"[itl] {label:<7} p50 {row['itl_ms']['p50']:.2f} ms  p99 {row['itl_ms']['p99']:.2f} ms")
    finally:
        fleet.stop()
    import statistics

    def median_p99(label: str) -> float:
        return statistics.median(r["itl_ms"]["p99"] for r in out["runs"] if r["path"] == label)

    out["p99_direct_ms"], out["p99_router_ms"] = median_p99("direct"), median_p99("router")
    out["router_adds_p99_ms"] = out["p99_router_ms"] - out["p99_direct_ms"]
    return out


# ---- the command ---------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="stallfree bench router", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", choices=("load", "affinity", "both"), default="both")
    p.add_argument("--policies", default=",".join(POLICIES), help="comma-separated, from " + ", ".join(POLICIES))
    p.add_argument("--load", type=float, default=0.8, help="offered prefill load over the combined capacity")
    p.add_argument("--duration-s", type=float, default=None,
                   help="seconds of arrivals per policy (60), or per phase with --objectives (25)")
    p.add_argument("--token-budget", type=int, default=512)
    p.add_argument("--profile-seconds", type=float, default=8.0, help="each sim daemon's start-up profile cap")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--itl", action="store_true", help="measure what the router adds to ITL at --itl-streams instead")
    p.add_argument("--itl-streams", type=int, default=64)
    p.add_argument("--itl-tokens", type=int, default=128)
    p.add_argument("--itl-rounds", type=int, default=2)
    p.add_argument("--faults", action="store_true",
                   help="instead: 3 replica kills and one SIGSTOP freeze through the router (bench/router_faults.py)")
    p.add_argument("--freeze-s", type=float, default=20.0, help="--faults: how long the frozen replica stays stopped")
    p.add_argument("--rate", type=float, default=20.0, help="--faults: requests per second")
    o = p.add_argument_group("--objectives: interactive and batch through the router (bench/router_objectives.py)")
    o.add_argument("--objectives", action="store_true",
                   help="instead: interactive (priority 10) alone, then beside a sheddable batch flood (priority -1)")
    o.add_argument("--interactive-load", type=float, default=0.6, help="interactive prefill demand over capacity")
    o.add_argument("--flood", type=float, default=3.0, help="the batch flood's prefill demand over capacity")
    o.add_argument("--interactive-ttft-ms", type=float, default=1000.0, help="interactive's TTFT target")
    o.add_argument("--batch-ttft-ms", type=float, default=4000.0, help="batch's TTFT target (shed when predicted past)")
    o.add_argument("--flood-bound", type=float, default=1.5,
                   help="interactive p99 TTFT with the flood over without, at most: the band goes first in the "
                        "router's queue, so the flood costs it only the batch prefill flow control lets onto its "
                        "replica (the dispatch wait) and the batch decodes beside it")
    p.add_argument("--quick", action="store_true", help="smoke test: a few seconds per policy, two policies")
    p.add_argument("--json", default="bench-router.json")
    p.add_argument("--plot", default="bench-router.png")
    p.add_argument("--log-dir", default=None, help="daemon and router logs (default: a temporary folder)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.duration_s is None:
        args.duration_s = 25.0 if args.objectives else 60.0
    policies = tuple(p.strip() for p in args.policies.split(",") if p.strip())
    bad = [p for p in policies if p not in POLICIES]
    if bad or not policies or not 0 < args.load <= 2 or args.duration_s <= 0:
        print(f"stallfree bench router: error: unknown policies {bad} or bad --load/--duration-s", file=sys.stderr)
        return 2
    if args.objectives and (not 0 < args.interactive_load <= 2 or args.flood <= 0 or args.flood_bound < 1
                            or args.interactive_ttft_ms <= 0 or args.batch_ttft_ms <= 0):
        print("stallfree bench router: error: --objectives needs 0 < --interactive-load <= 2, --flood > 0, "
              "--flood-bound >= 1 and positive TTFT targets", file=sys.stderr)
        return 2
    if args.quick:
        args.duration_s = min(args.duration_s, 12.0 if args.faults else 6.0)
        args.profile_seconds = min(args.profile_seconds, 3.0)
        args.itl_streams, args.itl_tokens, args.itl_rounds = min(args.itl_streams, 8), min(args.itl_tokens, 16), 1
        policies = tuple(p for p in policies if p in ("slo-aware", "round-robin", "slo-aware-immediate")) or policies[:1]
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="stallfree-bench-router-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    payload: dict[str, Any] = {"model": MODEL,
                               "token_budget": args.token_budget, "offered_load": args.load, "duration_s": args.duration_s}
    if args.objectives:
        from stallfree.bench import router_objectives

        config = router_objectives.ObjectivesConfig(
            duration_s=args.duration_s, interactive_load=args.interactive_load, flood=args.flood,
            interactive_ttft_ms=args.interactive_ttft_ms, batch_ttft_ms=args.batch_ttft_ms,
            flood_bound=args.flood_bound, token_budget=args.token_budget, seed=args.seed,
            profile_s=min(args.profile_seconds, 3.0))
        if args.quick:
            config.duration_s, config.fresh_daemons = min(config.duration_s, 5.0), False
        payload["objectives"] = router_objectives.run(config, log_dir, say)
        for line in router_objectives.table(payload["objectives"]):
            say(line)
        # A --quick run is a smoke test of the machinery: the p99 ratio of a few seconds is shown, not judged.
        for g in payload["objectives"]["goals"]:
            if args.quick and g["goal"].startswith("interactive p99"):
                g["met"] = None
            say(f"{'----' if g['met'] is None else 'MET ' if g['met'] else 'MISS'} {g['goal']}: {g['figures']}")
        payload["goals"] = payload["objectives"]["goals"]
    elif args.faults:
        from stallfree.bench.router_faults import FaultConfig, FaultRun, table as fault_table

        config = FaultConfig(duration_s=args.duration_s, rate=args.rate, freeze_s=args.freeze_s, seed=args.seed)
        if args.quick:
            config.freeze_s, config.rate = min(config.freeze_s, 3.0), min(config.rate, 10.0)
        say(f"[faults] 4 sim daemons, {config.rate:g} req/s for {config.duration_s:g}s through the router; "
            f"kills at {', '.join(f'{f:.0%}' for f in config.kill_at)}, a {config.freeze_s:g}s freeze at "
            f"{config.freeze_at:.0%}")
        payload["faults"] = asyncio.run(FaultRun(config, log_dir).run())
        for line in fault_table(payload["faults"]):
            say(line)
    elif args.itl:
        payload["itl"] = run_itl(args, log_dir)
        itl = payload["itl"]
        say(f"router adds {itl['router_adds_p99_ms']:+.2f} ms to p99 ITL at {itl['streams']} streams "
            f"({itl['p99_router_ms']:.2f} vs {itl['p99_direct_ms']:.2f} ms, medians of {args.itl_rounds} runs)")
    else:
        results = []
        setups = []
        if args.workload in ("load", "both"):
            setups.append(Setup("load", 8192, policies))
        if args.workload in ("affinity", "both"):
            # 2048 blocks of 16 = 32k tokens per replica
            setups.append(Setup("affinity", 2048, policies, fleet=AFFINITY_FLEET))
        for setup in setups:
            results.append(run_setup(setup, args, log_dir))
            payload[setup.name] = {k: v for k, v in results[-1].items()}
        for result in results:
            say(f"\n{result['workload']} workload: {result['num_requests']} requests at {result['rate']:.2f} req/s, "
                f"{args.load:.0%} of {result['capacity_tokens_per_s']:,.0f} prefill tok/s")
            for line in table(result):
                say(line)
        checks = goals(payload.get("load"), payload.get("affinity"))
        # A --quick run is a smoke test of the machinery (seconds of load): its figures are shown, not judged.
        judged = not args.quick
        payload["goals"] = [{"goal": g, "met": m if judged else None, "figures": f} for g, m, f in checks]
        if checks:
            say("" if judged else "\n(--quick: a few seconds of load; the goals below are shown, not judged)")
        for goal, met, figures in checks:
            say(f"{('MET ' if met else 'MISS') if judged else '----'} {goal}: {figures}")
        plot(results, args.plot)
        say(f"wrote {args.plot}")
    Path(args.json).write_text(json.dumps(payload, indent=2))
    say(f"wrote {args.json} (logs in {log_dir})")
    missed = [g["goal"] for g in payload.get("goals", []) if g["met"] is False]
    if missed:
        say(f"missed {len(missed)} goal(s): " + "; ".join(missed))
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
