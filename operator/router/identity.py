"""Who a request is (pure but for the keys file): its tenant and the objectives it may name, from credentials.

- With API keys (`--api-keys-file`, api_keys.py): the key in `Authorization: Bearer` names the tenant and its
  objectives; no key, or one that is not in the file, is a 401 before anything is queued or counted. The admin
  token is accepted too, as the tenant `admin` with every objective (operators' own checks).
- Without keys (anonymous serving): every client is one tenant, `anonymous`, with every objective.
- The tenant header (`x-gateway-inference-fairness-id`) a client sends is ignored, unless the request comes from
  the trusted upstream gateway the operator names (`--trusted-upstream-secret-file`): a request carrying that
  shared secret in `x-stallfree-upstream-secret` is the gateway's, which authenticated its users itself, so its
  tenant header is believed (without one: the tenant `gateway`) and every objective allowed.
A named objective the caller may not use is a 403 (objective_check).
"""
from __future__ import annotations

import hmac
from dataclasses import dataclass
from typing import Iterable

from stallfree.operator.router.api_keys import KeyBook
from stallfree.operator.router.objectives import MAX_TENANT_CHARS, TENANT_HEADER, Objective, Objectives

UPSTREAM_SECRET_HEADER = "x-stallfree-upstream-secret"
ANONYMOUS = "anonymous"
ADMIN = "admin"
GATEWAY = "gateway"


@dataclass(frozen=True)
class Caller:
    tenant: str
    objectives: frozenset[str] | None = None  # None: every objective

    def may_use(self, objective: Objective) -> bool:
        return self.objectives is None or objective.name in self.objectives


@dataclass(frozen=True)
class Unauthorized:
    status: int
    message: str
    code: str


def identify(headers: Iterable[tuple[bytes, bytes]], keys: KeyBook | None, admin_token: str | None,
             upstream_secret: str | None, now_s: float) -> Caller | Unauthorized:
    """The caller of a request with these (ASGI, lower-case) headers."""
    bearer = tenant_claim = upstream = None
    for name, value in headers:
        if name == b"authorization" and bearer is None:
            scheme, _, token = value.decode("latin-1").partition(" ")
            bearer = token.strip() if scheme.lower() == "bearer" else ""
        elif name == TENANT_HEADER_BYTES and tenant_claim is None:
            tenant_claim = value.decode("latin-1").strip()[:MAX_TENANT_CHARS]
        elif name == UPSTREAM_SECRET_HEADER_BYTES and upstream is None:
            upstream = value
    if upstream_secret and upstream is not None and hmac.compare_digest(upstream, upstream_secret.encode()):
        return Caller(tenant_claim or GATEWAY)
    if admin_token and bearer and hmac.compare_digest(bearer.encode(), admin_token.encode()):
        return Caller(ADMIN)
    if keys is None:
        return Caller(ANONYMOUS)
    if not bearer:
        return Unauthorized(401, "this router needs an API key: send it as `Authorization: Bearer <key>`",
                            "missing_api_key")
    holder = keys.holder(bearer, now_s)
    if holder is None:
        return Unauthorized(401, "the API key is not valid (unknown, revoked or mistyped)", "invalid_api_key")
    return Caller(holder.tenant, holder.objectives)


def objective_for(caller: Caller, named: Objective, header_given: bool,
                  objectives: Objectives) -> Objective | Unauthorized:
    """The objective a request is served under: the one it named, if its caller may use it (else a 403); with no
    header, the service's default, or the caller's first allowed one when the default is not among them."""
    if caller.may_use(named):
        return named
    if not header_given:
        usable = [objectives.by_name[n] for n in sorted(caller.objectives or ()) if n in objectives.by_name]
        if usable:
            return usable[0]
    allowed = ", ".join(sorted(caller.objectives or ()))
    return Unauthorized(403, f"the objective {named.name!r} is not allowed for this API key (allowed: {allowed})",
                        "objective_not_allowed")


TENANT_HEADER_BYTES = TENANT_HEADER.encode()
UPSTREAM_SECRET_HEADER_BYTES = UPSTREAM_SECRET_HEADER.encode()
