"""The door flags `stallfree serve` and `stallfree router` share, with one set of defaults."""
from __future__ import annotations

import argparse


def add_door_flags(group: argparse._ArgumentGroup) -> None:
    """Body size, header and body deadlines, and the connection cap (probes are still answered past it)."""
    group.add_argument("--max-body-bytes", type=int, default=4 << 20, help="request bodies above this get 413")
    group.add_argument("--header-timeout-s", type=float, default=10.0,
                       help="a request's headers must arrive within this, else 408 and the connection closes")
    group.add_argument("--body-timeout-s", type=float, default=30.0,
                       help="a request's body must arrive within this after its headers, else 408")
    group.add_argument("--max-connections", type=int, default=4096,
                       help="open connections before new ones get 503 and are closed (probes still answered)")
