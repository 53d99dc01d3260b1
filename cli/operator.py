"""`stallfree operator`: run the kopf operator against the cluster KUBECONFIG (or the pod's account) names.

Loads the reconciler (handlers.py) and, where it is installed, the SLO control loop
(control_handlers.py: kopf timers that tune and scale). kopf serves a liveness endpoint that
answers while its event loop is alive, for the Deployment's livenessProbe.
"""
from __future__ import annotations

import argparse
import importlib
import logging
import sys

CONTROL_HANDLERS = "stallfree.operator.reconcile.control_handlers"


def load_handlers(with_control_loop: bool) -> list[str]:
    """Import the handler modules (registering them with kopf); returns the ones loaded."""
    importlib.import_module("stallfree.operator.reconcile.handlers")
    loaded = ["stallfree.operator.reconcile.handlers"]
    if with_control_loop:
        try:
            importlib.import_module(CONTROL_HANDLERS)
            loaded.append(CONTROL_HANDLERS)
        except ModuleNotFoundError as exc:
            if exc.name != CONTROL_HANDLERS:
                raise
            logging.getLogger("stallfree.operator").warning(
                "%s is not installed: reconciling only, no live tuning or scaling", CONTROL_HANDLERS)
    return loaded


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="stallfree operator", description=__doc__)
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument("-n", "--namespace", action="append", default=[],
                       help="watch this namespace (repeatable; globs allowed); default: all namespaces")
    scope.add_argument("-A", "--all-namespaces", action="store_true", help="watch every namespace (the default)")
    parser.add_argument("--liveness-port", type=int, default=8080, help="serve /healthz here (0: off)")
    parser.add_argument("--liveness-host", default="0.0.0.0")
    parser.add_argument("--no-control-loop", action="store_true", help="reconcile only: no tuning or scaling")
    parser.add_argument("-v", "--verbose", action="store_true")
    return parser


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)

    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import kopf  # after argparse: `stallfree operator --help` stays quick

    loaded = load_handlers(with_control_loop=not args.no_control_loop)
    logging.getLogger("stallfree.operator").info("handlers: %s", ", ".join(loaded))
    liveness = f"http://{args.liveness_host}:{args.liveness_port}/healthz" if args.liveness_port else None
    kopf.run(
        standalone=True,  # one operator replica (Recreate strategy); no peering CRDs needed
        clusterwide=not args.namespace,
        namespaces=args.namespace or (),
        liveness_endpoint=liveness,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
