"""The router's word on how long a request waited in its queue, signed so that a daemon believes only the router.

A daemon adds the router's queue wait to the request's queue wait and TTFT, which the control loop reads; sent by
a client straight to a daemon, an unsigned header would let anyone set those figures. The router signs the value
with the admin token (which it and every daemon hold) as an HMAC over the value and the time of signing; the
daemon uses the value only when the signature matches and is recent, so a header seen once cannot be reused later.
`sign` and `verify` are the one signing rule of what the router tells a daemon: request_objective_header uses them too.
"""
from __future__ import annotations

import hashlib
import hmac

QUEUE_HEADER = "x-stallfree-router-queue-ms"
SIGNATURE_HEADER = "x-stallfree-router-queue-sig"
# How far the signing time may be from the daemon's clock: generous for clock skew between nodes.
MAX_AGE_S = 300.0


def _mac(token: str, value: str, stamp: str) -> str:
    return hmac.new(token.encode(), f"{value}\n{stamp}".encode(), hashlib.sha256).hexdigest()


def sign(value: str, token: str, now_s: float) -> str:
    """The signature header's value for the queue header's `value`, signed at wall-clock time `now_s`."""
    stamp = f"{now_s:.3f}"
    return f"{stamp}:{_mac(token, value, stamp)}"


def verify(value: str, signature: str | None, token: str | None, now_s: float) -> bool:
    """True when `signature` is the router's for `value`, made within MAX_AGE_S of `now_s` (never without a token)."""
    if not token or not signature:
        return False
    stamp, _, mac = signature.partition(":")
    try:
        signed_at = float(stamp)
    except ValueError:
        return False
    if not abs(now_s - signed_at) <= MAX_AGE_S:  # NaN fails too
        return False
    return hmac.compare_digest(mac.encode(), _mac(token, value, stamp).encode())
