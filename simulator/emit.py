"""A workload run's report, as `stallfree simulate` and `stallfree bench serve` both print it: text or JSON.

Both commands take the same workload flags and summaries (workload_args.py, latency_summary.py, plots.py); this is
their shared --json/--plot output.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def emit(args: argparse.Namespace, payload: Any, text: str) -> None:
    """Print the text (or the JSON to stdout with --json -), write --json FILE, and say what was written."""
    if args.json == "-":
        print(json.dumps(payload, indent=2))
    else:
        print(text)
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(payload, fh, indent=2)
            print(f"wrote {args.json}")
    if args.plot:
        print(f"wrote {args.plot}", file=sys.stderr if args.json == "-" else sys.stdout)
