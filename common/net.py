"""Network helpers shared by the local runtime, the router, the benchmarks and the tests (standard library only)."""
from __future__ import annotations

import socket


def free_port() -> int:
    """A loopback TCP port that was free a moment ago (the OS picks it; a caller binds it soon after)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
