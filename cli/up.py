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
import sys
import time
from pathlib import Path

import httpx

from stallfree.operator.local.closed_loop_run import RunOptions, run
from stallfree.operator.local.manifest import load_manifest
from stallfree.operator.local.report import summary_text


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


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    try:
        name, spec = load_manifest(args.filename)
    except ValueError as exc:
        print(f"stallfree up: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out or f"runs/up-{time.strftime('%Y%m%d-%H%M%S')}")
    options = RunOptions(demo=args.demo, duration_s=args.duration, threads_per_replica=args.threads_per_replica,
                         start_timeout_s=args.start_timeout, interval_s=args.interval, live=not args.no_live,
                         phase_scale=args.phase_scale)
    try:
        result = asyncio.run(run(options, name, spec, out))
    except (RuntimeError, TimeoutError, httpx.HTTPError) as exc:
        print(f"stallfree up: {exc}", file=sys.stderr)
        return 1
    print(summary_text(result, out))
    # The demo fails when the loop left an SLO it judged feasible unrestored.
    return 0 if result.get("verdict", {}).get("ok", True) else 1
