"""`stallfree crd`: print the InferenceService CustomResourceDefinition (pipe it to `kubectl apply -f -`)."""
from __future__ import annotations

import argparse
import json
import sys

from stallfree.operator.api.crd import crd_yaml, custom_resource_definition


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="stallfree crd", description=__doc__)
    parser.add_argument("--format", choices=["yaml", "json"], default="yaml")
    parser.add_argument("-o", "--output", help="write to this file instead of stdout")
    args = parser.parse_args(argv)
    text = crd_yaml() if args.format == "yaml" else json.dumps(custom_resource_definition(), indent=2) + "\n"
    if args.output:
        with open(args.output, "w") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
