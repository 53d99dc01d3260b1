"""`stallfree control --scenario NAME [--json] [--plot PNG]`: closed-loop runs in virtual time.

The real tuner, scaler and control loop drive VirtualReplicas (the real scheduler and KV manager on the
cost model). Prints the run's timeline, the figures its claim rests on, and every SLO judged (windows
within, restore times after the replicas were ready, reversals) beside an offline oracle's replica-minutes
(the fewest replicas meeting every SLO, knowing the load). The JSON carries each scenario's
`replica_minutes_over_oracle` and `slo_window_fraction` (the worst over its SLOs). Exits 1 when any scenario
misses any of its checks or goals (the backlog drained within 3 intervals of the replicas being ready, >= 95% of
windows within every feasible SLO after the first breach, replica-minutes <= 1.15x the oracle's, at most one
reversal per load change, and a scenario's own goals); each miss is printed with the figure that missed.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys

from stallfree.simulator.closed_loop_judge import format_table
from stallfree.simulator.closed_loop_scenarios import SCENARIOS, run_scenario
from stallfree.operator.control.timeline import format_row


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="stallfree control", description=__doc__.splitlines()[0])
    parser.add_argument("--scenario", required=True, action="append", choices=[*SCENARIOS, "all"],
                        help="which run (repeatable; 'all' runs every one)")
    parser.add_argument("--seed", type=int, default=None, help="seed of the arrivals (default: the scenario's)")
    parser.add_argument("--json", nargs="?", const="-", metavar="FILE",
                        help="write the results (timeline, summary, checks) as JSON to FILE, or stdout")
    parser.add_argument("--plot", metavar="PNG", help="save the timeline as PNG (one file per scenario: "
                        "NAME.png becomes NAME-<scenario>.png when several run)")
    parser.add_argument("--quiet", action="store_true", help="print only the summaries, not every step")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    names = list(SCENARIOS) if "all" in args.scenario else list(dict.fromkeys(args.scenario))
    results = []
    to_stdout = args.json == "-"
    out = sys.stderr if to_stdout else sys.stdout
    for name in names:
        result = asyncio.run(run_scenario(name, args.seed)).to_dict()
        results.append(result)
        print(f"== {name}: {result['claim']}", file=out)
        if not args.quiet:
            for row in result["timeline"]:
                print("  " + format_row(row), file=out)
        for key, value in result["summary"].items():
            print(f"  {key}: {value}", file=out)
        for check, ok in result["checks"].items():
            print(f"  [{'ok' if ok else 'FAIL'}] {check}", file=out)
        for line in format_table(name, result["judged"], result["oracle"] or None):
            print(line, file=out)
        for goal, ok in result["judged"]["goals"].items():
            print(f"  [{'met' if ok else 'missed'}] goal: {goal}", file=out)
        if args.plot:
            from stallfree.simulator.closed_loop_plot import plot_timeline

            path = args.plot if len(names) == 1 else _per_scenario(args.plot, name)
            plot_timeline(result, path)
            print(f"  plot: {path}", file=out)
    if args.json:
        payload = json.dumps(results[0] if len(results) == 1 else results, indent=1, default=str)
        if to_stdout:
            print(payload)
        else:
            with open(args.json, "w") as handle:
                handle.write(payload)
    missed = [(r["scenario"], m) for r in results for m in r["missed"]]
    if missed:
        print(f"missed ({len(missed)}):", file=out)
        for name, what in missed:
            print(f"  {name}: {what}", file=out)
    return 0 if all(r["ok"] for r in results) else 1


def _per_scenario(path: str, name: str) -> str:
    stem, dot, ext = path.rpartition(".")
    return f"{stem}-{name}.{ext}" if dot else f"{path}-{name}"


if __name__ == "__main__":
    sys.exit(main())
