"""The router's word on a request's objective (name, priority, deadline, TPOT target), signed so that a daemon
believes only the router.

The daemon's scheduler orders its waiting queue and its prefill chunks by priority and deadline, and picks the
lowest priority to preempt; a client that could set these straight at a daemon would jump every queue. So the
router sends them as one compact JSON value signed by the one rule of router_queue_header (an HMAC with the admin
token over the value and the time of signing); a daemon that cannot verify the signature, or cannot read the
value, treats the request as having no objective (priority 0, no deadline: first come, first served).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Mapping

from stallfree.router_queue_header import sign, verify

OBJECTIVE_HEADER = "x-stallfree-request-objective"
SIGNATURE_HEADER = "x-stallfree-request-objective-sig"
MAX_NAME_CHARS = 128
MAX_PRIORITY = 1 << 31  # |priority| bound: the value is a sort key, not a number to compute with


@dataclass(frozen=True)
class RequestObjective:
    name: str
    priority: int = 0
    deadline_s: float | None = None  # wall-clock epoch seconds: arrival at the router plus the TTFT target
    tpot_ms: float | None = None


def encode(objective: RequestObjective) -> str:
    """The header's value: compact JSON (ASCII, one line), absent fields left out."""
    fields: dict[str, object] = {"name": objective.name, "priority": objective.priority}
    if objective.deadline_s is not None:
        fields["deadline"] = round(objective.deadline_s, 3)
    if objective.tpot_ms is not None:
        fields["tpot_ms"] = objective.tpot_ms
    return json.dumps(fields, separators=(",", ":"), sort_keys=True)


def decode(value: str) -> RequestObjective | None:
    """The objective a header value names, or None when it is not one this module wrote."""
    try:
        fields = json.loads(value)
    except ValueError:
        return None
    if not isinstance(fields, dict):
        return None
    name, priority = fields.get("name"), fields.get("priority", 0)
    deadline, tpot = fields.get("deadline"), fields.get("tpot_ms")
    if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME_CHARS:
        return None
    if not isinstance(priority, int) or isinstance(priority, bool) or abs(priority) > MAX_PRIORITY:
        return None
    if deadline is not None and not _finite(deadline):
        return None
    if tpot is not None and not (_finite(tpot) and tpot > 0):
        return None
    return RequestObjective(name, priority, None if deadline is None else float(deadline),
                            None if tpot is None else float(tpot))


def headers(objective: RequestObjective, token: str | None, now_s: float) -> list[tuple[str, str]]:
    """The two headers the router sends a daemon; none without an admin token (a daemon would ignore them)."""
    if not token:
        return []
    value = encode(objective)
    return [(OBJECTIVE_HEADER, value), (SIGNATURE_HEADER, sign(value, token, now_s))]


def read(request_headers: Mapping[str, str], token: str | None, now_s: float) -> RequestObjective | None:
    """The router's signed objective of a request; None when it carries none, or one that is not the router's
    (unsigned, forged, stale, unreadable): the daemon ignores those."""
    value = request_headers.get(OBJECTIVE_HEADER)
    if value is None or not verify(value, request_headers.get(SIGNATURE_HEADER), token, now_s):
        return None
    return decode(value)


def _finite(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
