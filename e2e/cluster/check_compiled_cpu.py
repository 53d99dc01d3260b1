"""Fail the serving-cpu image's build unless the compiled CPU forward compiles and loads in it.

The daemon builds that library (node_daemon/models/cpu_decode.py) for the node's CPU at start-up, with the
image's C++ compiler and ninja; without them it would serve on the Python path, several times slower. This
runs the same build once, for the build machine's CPU, into a scratch cache that the image does not keep.
tests/test_images.py runs it without ninja on PATH and sees it fail.
"""
from __future__ import annotations

import os
import sys
import tempfile


def main() -> int:
    with tempfile.TemporaryDirectory() as scratch:
        os.environ["STALLFREE_EXT_CACHE"] = scratch
        from stallfree.node_daemon.models import cpu_decode

        if cpu_decode.ensure_built(background=False):
            print("compiled CPU forward: built and loaded")
            return 0
        print(f"compiled CPU forward: {cpu_decode.why_not()}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
