"""`stallfree render -f FILE`: print, as YAML, every object the operator would create for the InferenceServices
in FILE (as `helm template` does), so they can be reviewed, diffed or validated before `kubectl apply`."""
from __future__ import annotations

import argparse
import sys

import yaml

from stallfree.operator.reconcile.preview import InvalidManifest, preview


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="stallfree render", description=__doc__)
    p.add_argument("-f", "--filename", required=True, help="a manifest with one or more InferenceServices ('-': stdin)")
    p.add_argument("-n", "--namespace", help="namespace of the objects (default: the manifest's, else default)")
    p.add_argument("--routing-mode", choices=["slo-aware", "service"], help="override spec.routing.mode")
    p.add_argument("--no-service-monitor", action="store_true",
                   help="as in a cluster without the Prometheus Operator's API (no ServiceMonitor, no SLO PrometheusRule)")
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    try:
        text = sys.stdin.read() if args.filename == "-" else open(args.filename).read()
        documents = [d for d in yaml.safe_load_all(text) if d]
    except OSError as exc:
        print(f"stallfree render: cannot read {args.filename}: {exc.strerror}", file=sys.stderr)
        return 2
    except yaml.YAMLError as exc:
        print(f"stallfree render: {args.filename} is not valid YAML: {exc}", file=sys.stderr)
        return 2
    services = [d for d in documents if isinstance(d, dict) and d.get("kind") == "InferenceService"]
    if not services:
        print(f"stallfree render: {args.filename} holds no InferenceService", file=sys.stderr)
        return 2
    objects = []
    try:
        for manifest in services:
            objects += preview(manifest, args.namespace, routing_mode=args.routing_mode,
                               with_service_monitor=not args.no_service_monitor)
    except InvalidManifest as exc:
        print(f"stallfree render: {exc}", file=sys.stderr)
        return 1
    sys.stdout.write(yaml.safe_dump_all(objects, sort_keys=False))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
