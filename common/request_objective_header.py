"""The router's word on a request's objective (name, priority, deadline, TPOT target), signed so that a daemon
believes only the router.

The daemon's scheduler orders its waiting queue and its prefill chunks by priority and deadline, and picks the
lowest priority to preempt; a client that could set these straight at a daemon would jump every queue. So the
router sends them as one compact JSON value signed by the one rule of router_queue_header (an HMAC with the admin
token over the value and the time of signing); a daemon that cannot verify the signature, or cannot read the
value, treats the request as having no objective (priority 0, no deadline: first come, first served).

The value is bound to its request, so a header seen once (in a log, on the wire) is worth nothing elsewhere: it
carries the router's request id (also sent as `x-request-id`), the SHA-256 of the body as forwarded, the replica it
was sent to (host:port, as the router dials it) and a random nonce. A daemon believes it only for that id and that
very body, arriving at its own address (the connection's local address: an IP must match it, a host name only its
port), and only once: it remembers each nonce until its signature expires (NonceBook).
"""
from __future__ import annotations

import hashlib
import heapq
import ipaddress
import json
import math
import secrets
from dataclasses import dataclass
from typing import Mapping
from urllib.parse import urlsplit

from stallfree.router_queue_header import MAX_AGE_S, sign, verify

OBJECTIVE_HEADER = "x-stallfree-request-objective"
SIGNATURE_HEADER = "x-stallfree-request-objective-sig"
REQUEST_ID_HEADER = "x-request-id"
MAX_NAME_CHARS = 128
MAX_PRIORITY = 1 << 31  # |priority| bound: the value is a sort key, not a number to compute with


@dataclass(frozen=True)
class RequestObjective:
    name: str
    priority: int = 0
    deadline_s: float | None = None  # wall-clock epoch seconds: arrival at the router plus the TTFT target
    tpot_ms: float | None = None


@dataclass(frozen=True)
class Binding:
    """What ties a signed objective to one request: the router's id for it, its body's digest, a nonce."""

    request_id: str
    body_sha256: str
    nonce: str
    target: str  # the replica's host:port as the router dials it


def body_digest(body: bytes) -> str:
    return hashlib.sha256(body).hexdigest()


def bind(request_id: str, body_sha256: str, replica_url: str) -> Binding:
    """A new binding (a fresh nonce: one per attempt) for the request `request_id` whose body, as forwarded, has
    the digest `body_sha256` (body_digest), sent to the replica at `replica_url`."""
    return Binding(request_id, body_sha256, secrets.token_hex(12), urlsplit(replica_url).netloc)


def at_target(target: str, server: tuple[str, int] | None) -> bool:
    """Whether a request signed for `target` (host:port) arrived at this listener (`server`: the connection's local
    address, the ASGI scope's). An IP must be this one; a host name is judged by its port alone."""
    if server is None:
        return False
    parts = urlsplit("//" + target)
    try:
        port = parts.port
    except ValueError:
        return False
    if port is not None and port != server[1]:
        return False
    try:
        signed_ip = ipaddress.ip_address(parts.hostname or "")
    except ValueError:
        return True
    try:
        return signed_ip == ipaddress.ip_address(server[0])
    except ValueError:
        return False


def encode(objective: RequestObjective, binding: Binding | None = None) -> str:
    """The header's value: compact JSON (ASCII, one line), absent fields left out."""
    fields: dict[str, object] = {"name": objective.name, "priority": objective.priority}
    if binding is not None:
        fields.update(rid=binding.request_id, body=binding.body_sha256, nonce=binding.nonce, to=binding.target)
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
    return _objective(fields) if isinstance(fields, dict) else None


def _binding(fields: dict) -> Binding | None:
    parts = fields.get("rid"), fields.get("body"), fields.get("nonce"), fields.get("to")
    if not all(isinstance(p, str) and 0 < len(p) <= MAX_NAME_CHARS for p in parts):
        return None
    return Binding(*parts)


def _objective(fields: dict) -> RequestObjective | None:
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


def headers(objective: RequestObjective, token: str | None, now_s: float,
            binding: Binding) -> list[tuple[str, str]]:
    """The headers the router sends a daemon (the objective, its signature, the request id); none without an admin
    token (a daemon would ignore them)."""
    if not token:
        return []
    value = encode(objective, binding)
    return [(OBJECTIVE_HEADER, value), (SIGNATURE_HEADER, sign(value, token, now_s)),
            (REQUEST_ID_HEADER, binding.request_id)]


class NonceBook:
    """The nonces a daemon has believed, each until its signature expires; bounded (past `capacity` live nonces
    nothing more is believed until some expire: a flood of genuine requests is served, only without objectives)."""

    def __init__(self, capacity: int = 500_000) -> None:
        self.capacity = capacity
        self._expiry: list[tuple[float, str]] = []  # a heap: the next to expire first
        self._live: set[str] = set()

    def first_use(self, nonce: str, signed_at_s: float, now_s: float) -> bool:
        """True (and remembered) the first time `nonce` comes within its window; False for a replay or when full."""
        while self._expiry and self._expiry[0][0] < now_s:
            self._live.discard(heapq.heappop(self._expiry)[1])
        if nonce in self._live or len(self._live) >= self.capacity:
            return False
        self._live.add(nonce)
        heapq.heappush(self._expiry, (signed_at_s + MAX_AGE_S, nonce))
        return True

    def __len__(self) -> int:
        return len(self._live)


def read(request_headers: Mapping[str, str], token: str | None, now_s: float, body: bytes,
         server: tuple[str, int] | None, nonces: NonceBook) -> RequestObjective | None:
    """The router's signed objective of this request (`body` as received, on the listener `server`); None when it
    carries none, or one that is not the router's for it (unsigned, forged, stale, unreadable, made for another id,
    body or replica, or seen before): the daemon ignores those."""
    value = request_headers.get(OBJECTIVE_HEADER)
    signature = request_headers.get(SIGNATURE_HEADER)
    if value is None or not verify(value, signature, token, now_s):
        return None
    try:
        fields = json.loads(value)
    except ValueError:
        return None
    if not isinstance(fields, dict):
        return None
    objective, binding = _objective(fields), _binding(fields)
    if objective is None or binding is None or request_headers.get(REQUEST_ID_HEADER) != binding.request_id:
        return None
    if not at_target(binding.target, server) or body_digest(body) != binding.body_sha256:
        return None
    signed_at = float(signature.partition(":")[0])  # verify() parsed it already
    return objective if nonces.first_use(binding.nonce, signed_at, now_s) else None


def _finite(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
