"""`stallfree simulate`: workloads, the long-prompt scenario, capacity search and budget sweeps in virtual time.

Examples:
  stallfree simulate --model llama-3-8b --hardware h100 --rate 2 --policies stall-free,prefill-priority
  stallfree simulate --scenario long-prompt --decoders 64 --prompt-len 8192 --budget 576 --json
  stallfree simulate --capacity --model mistral-7b --hardware a100 --sharegpt --tbt-slo-ms 100 \\
      --policies stall-free,prefill-priority,decode-priority --budget 512 --num-requests 1000
  stallfree simulate --sweep-budgets 128,256,512,1024,2048 --tpot-slo-ms 50 --rate 3 --plot frontier.png
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import asdict
from typing import Any

from stallfree.node_daemon.sim.backend import build_cost_model
from stallfree.simulator.emit import emit
from stallfree.simulator.latency_summary import SLOs
from stallfree.simulator.simulate import POLICIES, SimSetup, simulate
from stallfree.simulator.workload import describe_workload, generate, workload_label
from stallfree.simulator.workload_args import add_workload_args, workload_from_args


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="stallfree simulate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    device = parser.add_argument_group("model and device")
    device.add_argument("--model", default="llama-3-8b", help="model shape name or a HF folder (config.json)")
    device.add_argument("--hardware", default="h100", help="a100 | h100 | h200 | textbook")
    device.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32", "fp8"))
    device.add_argument("--tflops", type=float, help="override the matrix FLOP rate (TFLOP/s)")
    device.add_argument("--hbm-tbps", type=float, help="override the HBM bandwidth (TB/s)")
    device.add_argument("--overhead-ms", type=float, help="override the fixed per-iteration overhead (ms)")
    engine = parser.add_argument_group("engine")
    engine.add_argument("--policy", default="stall-free", choices=tuple(POLICIES))
    engine.add_argument("--policies", help="comma-separated policies to compare (overrides --policy)")
    engine.add_argument("--budget", help="token budget, default 512 (the scenario takes a comma-separated list)")
    engine.add_argument("--no-chunking", action="store_true", help="scenario: whole prompts (prefill-priority)")
    engine.add_argument("--max-num-seqs", type=int, default=128)
    engine.add_argument("--max-partial-prefills", type=int, default=1)
    engine.add_argument("--long-prefill-threshold", type=int, default=0)
    engine.add_argument("--iteration-time-target-ms", type=float, help="policy stall-free-time: the target")
    engine.add_argument("--max-token-budget", type=int, help="budget ceiling (default: the budget)")
    engine.add_argument("--max-model-len", type=int, default=8192)
    engine.add_argument("--block-size", type=int, default=16)
    engine.add_argument("--kv-memory-fraction", type=float, default=0.9)
    engine.add_argument("--num-kv-blocks", type=int, help="KV blocks (default: from device memory after weights)")
    engine.add_argument("--no-prefix-caching", action="store_true")
    add_workload_args(parser)
    slo = parser.add_argument_group("SLOs (goodput)")
    slo.add_argument("--ttft-slo-ms", type=float)
    slo.add_argument("--tpot-slo-ms", type=float)
    slo.add_argument("--e2e-slo-ms", type=float)
    mode = parser.add_argument_group("modes")
    mode.add_argument("--scenario", choices=("long-prompt",), help="the textbook stall scenario")
    mode.add_argument("--decoders", type=int, default=64, help="scenario: users decoding when the prompt arrives")
    mode.add_argument("--decoder-prompt-len", type=int, default=1024)
    mode.add_argument("--decoder-output-len", type=int, default=2048)
    mode.add_argument("--capacity", action="store_true", help="bisect the highest rate that meets the criteria")
    mode.add_argument("--tbt-slo-ms", type=float, default=100.0, help="capacity: time-between-tokens SLO")
    mode.add_argument("--tbt-quantile", default="p99", choices=("p50", "p90", "p99", "max"))
    mode.add_argument("--max-median-queue-wait-ms", type=float, default=2000.0)
    mode.add_argument("--start-rate", type=float, default=1.0)
    mode.add_argument("--rel-tol", type=float, default=0.02)
    mode.add_argument("--sweep-budgets", help="comma-separated budgets: p99 TTFT and TPOT against the budget")
    mode.add_argument("--target-fraction", type=float, default=0.8,
                      help="sweep: the profile rule fits iterations to this share of the TPOT SLO")
    out = parser.add_argument_group("output")
    out.add_argument("--json", nargs="?", const="-", metavar="FILE", help="JSON to FILE, or to stdout without one")
    out.add_argument("--per-request", action="store_true", help="include every request in the JSON")
    out.add_argument("--plot", metavar="FILE.png", help="write a PNG figure")
    return parser


def _ints(text: str, flag: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"{flag} takes integers separated by commas, got {text!r}") from None
    if not values or min(values) < 1:
        raise ValueError(f"{flag} needs positive integers, got {text!r}")
    return values


def _setup(args: argparse.Namespace, policy: str, budget: int) -> SimSetup:
    setup = SimSetup(
        model=args.model, hardware=args.hardware, dtype=args.dtype, tflops=args.tflops, hbm_tbps=args.hbm_tbps,
        overhead_ms=args.overhead_ms, policy=policy, token_budget=budget, max_num_seqs=args.max_num_seqs,
        max_partial_prefills=args.max_partial_prefills, long_prefill_threshold=args.long_prefill_threshold,
        iteration_time_target_ms=args.iteration_time_target_ms, max_token_budget=args.max_token_budget,
        max_model_len=args.max_model_len, block_size=args.block_size, kv_memory_fraction=args.kv_memory_fraction,
        num_kv_blocks=args.num_kv_blocks, enable_prefix_caching=not args.no_prefix_caching,
    )
    setup.check()
    return setup


def _policies(args: argparse.Namespace) -> list[str]:
    names = [p.strip() for p in (args.policies or args.policy).split(",") if p.strip()]
    for name in names:
        if name not in POLICIES:
            raise ValueError(f"unknown policy {name!r}; choose from {', '.join(POLICIES)}")
    return names


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


# ---- modes ------------------------------------------------------------------------------------


def run_scenario(args: argparse.Namespace) -> int:
    from stallfree.simulator.scenarios import long_prompt_scenario

    prompt_len = 8192 if args.prompt_len == "sharegpt-prompt" else _ints(args.prompt_len.removeprefix("fixed:"),
                                                                          "--prompt-len")[0]
    max_model_len = max(args.max_model_len, prompt_len + 1, args.decoder_prompt_len + args.decoder_output_len)
    args.max_model_len = max_model_len
    cases: list[int | None] = [None] if args.no_chunking else []
    if not args.no_chunking or args.budget:
        cases += _ints(args.budget or "512", "--budget")
    results = []
    for budget in cases:
        setup = _setup(args, "stall-free", budget or 512)
        results.append(long_prompt_scenario(setup, args.decoders, prompt_len, args.decoder_prompt_len,
                                            args.decoder_output_len, no_chunking=budget is None))
    hw = results[0]["hardware"]
    lines = [f"{args.decoders} decoders ({args.decoder_prompt_len}-token prompts), then one {prompt_len}-token "
             f"prompt; {args.model} ({args.dtype}) on {hw['name']}: {hw['tflops']:g} TFLOP/s, {hw['hbm_tbps']:g} TB/s, "
             f"overhead {hw['overhead_ms']:g} ms"]
    lines.append(f"{'case':<14}{'max decode gap ms':>19}{'TTFT ms':>10}{'decode tokens':>15}{'iterations':>12}"
                 f"{'steady gap ms':>15}")
    for r in results:
        label = "no chunking" if r["no_chunking"] else f"budget {r['token_budget']}"
        lines.append(f"{label:<14}{r['max_decode_gap_ms']:>19.1f}{r['ttft_ms']:>10.1f}"
                     f"{r['decode_tokens_during_prefill']:>15}{r['prefill_iterations']:>12}"
                     f"{_fmt(r['steady_decode_gap_ms']):>15}")
    if args.plot:
        from stallfree.simulator.plots import scenario_bars

        scenario_bars(results, args.plot)
    emit(args, results[0] if len(results) == 1 else results, "\n".join(lines))
    return 0


def run_capacity(args: argparse.Namespace) -> int:
    from stallfree.simulator.capacity import CapacityCriteria, find_capacity

    workload = workload_from_args(args, max_total_len=args.max_model_len)
    criteria = CapacityCriteria(args.tbt_slo_ms, args.tbt_quantile, args.max_median_queue_wait_ms)
    budget = _ints(args.budget or "512", "--budget")[0]
    hardware = build_cost_model(args.model, args.hardware, args.dtype, tflops=args.tflops, hbm_tbps=args.hbm_tbps,
                                overhead_ms=args.overhead_ms).hardware
    results = []
    for policy in _policies(args):
        def progress(p, policy=policy) -> None:  # a search takes minutes: say what each probe found
            print(f"  {policy} at {p.rate:.3f} req/s: {criteria.tbt_quantile} TBT {_fmt(p.tbt_ms)} ms, median queue "
                  f"wait {_fmt(p.median_queue_wait_ms)} ms: {'pass' if p.ok else 'fail'}", file=sys.stderr, flush=True)

        result = find_capacity(workload, _setup(args, policy, budget), criteria, args.start_rate, args.rel_tol,
                               on_probe=progress)
        results.append(result.to_dict())
    lines = [f"capacity of {args.model} on {hardware.name} ({hardware.tflops:.4g} TFLOP/s, {hardware.hbm_tbps:.4g} TB/s "
             f"achieved, budget {budget}): {criteria.tbt_quantile} TBT <= {criteria.tbt_slo_ms:g} ms, median queue wait "
             f"<= {criteria.max_median_queue_wait_ms:g} ms, {workload.num_requests} requests "
             f"(prompt {workload.prompt.describe()}, output {workload.output.describe()})"]
    for r in results:
        lines.append(f"  {r['policy']:<18} {r['capacity_rps']:.3f} req/s ({len(r['probes'])} probes)")
    payload: dict[str, Any] = {"results": results, "hardware": asdict(hardware), "token_budget": budget}
    first = results[0]
    ratios = {r["policy"]: first["capacity_rps"] / r["capacity_rps"] for r in results[1:] if r["capacity_rps"] > 0}
    for policy, ratio in ratios.items():
        lines.append(f"  ratio {first['policy']} / {policy}: {ratio:.2f}x")
    if ratios:
        payload["ratios"] = {f"{first['policy']}/{policy}": ratio for policy, ratio in ratios.items()}
    if args.plot:
        from stallfree.simulator.plots import capacity_probes

        capacity_probes(results, args.plot)
    emit(args, payload, "\n".join(lines))
    return 0


def run_sweep(args: argparse.Namespace) -> int:
    from stallfree.simulator.sweep import budget_sweep

    workload = workload_from_args(args, max_total_len=args.max_model_len)
    slos = SLOs(args.ttft_slo_ms, args.tpot_slo_ms, args.e2e_slo_ms)
    budgets = _ints(args.sweep_budgets, "--sweep-budgets")
    setup = _setup(args, "stall-free", budgets[0])
    result = budget_sweep(workload, setup, budgets, slos, args.target_fraction).to_dict()
    described = describe_workload(workload, generate(workload))
    lines = [f"budget sweep, TPOT SLO {slos.tpot_ms:g} ms ({args.model} on {args.hardware}; {workload_label(described)})",
             f"{'budget':>8}{'p99 TTFT ms':>14}{'p99 TPOT ms':>14}{'p99 ITL ms':>13}{'p50 queue ms':>14}{'goodput':>10}"]
    for p in result["points"]:
        lines.append(f"{p['token_budget']:>8}{_fmt(p['ttft_p99_ms']):>14}{_fmt(p['tpot_p99_ms']):>14}"
                     f"{_fmt(p['itl_p99_ms']):>13}{_fmt(p['queue_wait_p50_ms']):>14}{p['goodput']:>10.3f}")
    lines.append(f"profile rule ({args.target_fraction:g} x TPOT SLO per iteration) picks {result['profile_budget']}; "
                 f"lowest p99 TTFT within the TPOT SLO: {result['best_budget']}")
    if args.plot:
        from stallfree.simulator.plots import budget_frontier

        budget_frontier(result, args.plot)
    emit(args, result, "\n".join(lines))
    return 0


def run_workload(args: argparse.Namespace) -> int:
    workload = workload_from_args(args, max_total_len=args.max_model_len)
    requests = generate(workload)
    slos = SLOs(args.ttft_slo_ms, args.tpot_slo_ms, args.e2e_slo_ms)
    budget = _ints(args.budget or "512", "--budget")[0]
    results = {}
    for policy in _policies(args):
        results[policy] = simulate(requests, _setup(args, policy, budget), slos, keep_timeline=bool(args.plot))
    header = (f"{'policy':<18}{'done':>6}{'req/s':>8}{'out tok/s':>10}{'TTFT p50/p99/max ms':>28}"
              f"{'TPOT p50/p99/max ms':>22}{'ITL p50/p99/max ms':>22}{'queue p50/p99 ms':>22}{'goodput':>9}")
    described = describe_workload(workload, requests)
    lines = [f"{len(requests)} requests on {args.model} @ {args.hardware} ({workload_label(described)})", header]
    for policy, result in results.items():
        s = result.summary

        def three(m: dict) -> str:
            return f"{_fmt(m['p50'])}/{_fmt(m['p99'])}/{_fmt(m['max'])}"

        lines.append(f"{policy:<18}{s['completed']:>6}{s['request_throughput']:>8.2f}{s['output_throughput']:>10.0f}"
                     f"{three(s['ttft_ms']):>28}{three(s['tpot_ms']):>22}{three(s['itl_ms']):>22}"
                     f"{_fmt(s['queue_wait_ms']['p50']) + '/' + _fmt(s['queue_wait_ms']['p99']):>22}"
                     f"{s['goodput']:>9.2f}")
    if args.plot:
        from stallfree.simulator.plots import latency_cdfs

        series = {policy: {"ttft_ms": [r["ttft_ms"] for r in res.requests],
                           "tpot_ms": [r["tpot_ms"] for r in res.requests],
                           "itl_ms": res.itl_ms, "e2e_ms": [r["e2e_ms"] for r in res.requests]}
                  for policy, res in results.items()}
        latency_cdfs(series, args.plot, f"{args.model} on {args.hardware}, {workload_label(described)}",
                     {"ttft_ms": slos.ttft_ms, "tpot_ms": slos.tpot_ms, "itl_ms": slos.tpot_ms, "e2e_ms": slos.e2e_ms})
    payload = {"workload": described,
               "results": {p: r.to_dict(per_request=args.per_request) for p, r in results.items()}}
    emit(args, payload, "\n".join(lines))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.scenario:
            return run_scenario(args)
        if args.capacity:
            return run_capacity(args)
        if args.sweep_budgets:
            return run_sweep(args)
        return run_workload(args)
    except ValueError as exc:
        print(f"stallfree simulate: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
