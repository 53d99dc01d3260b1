"""The headers a replica gets (pure): the client's, less what is the router's to set, plus the forwarding ones.

The router is the public door, so what a client says about where it came from (X-Forwarded-*, Forwarded,
X-Real-IP) is dropped and X-Forwarded-For / -Proto are set from the connection itself; headers that only
the router may send to a daemon (x-stallfree-*, such as the queue-time and the objective headers) are dropped too.
"""
from __future__ import annotations

import hmac

import httpx

# Hop-by-hop and length headers are each leg's own business; the encoding is httpx's on the upstream leg.
_HOP_BY_HOP = frozenset({"host", "content-length", "transfer-encoding", "connection", "keep-alive", "upgrade", "te",
                         "trailer", "proxy-authorization", "proxy-connection", "accept-encoding", "expect"})
_CLIENT_CLAIMS = frozenset({"forwarded", "x-real-ip", "x-forwarded-for", "x-forwarded-host", "x-forwarded-proto",
                            "x-forwarded-port", "x-forwarded-prefix"})
ROUTER_PREFIX = "x-stallfree-"  # headers only the router sends to a daemon
DROP_RESPONSE_HEADERS = frozenset({"content-length", "transfer-encoding", "connection", "keep-alive",
                                   "content-encoding", "date", "server"})


def upstream_headers(client_headers: list[tuple[bytes, bytes]], client: tuple[str, int] | None,
                     scheme: str) -> list[tuple[str, str | bytes]]:
    """The headers to send upstream, from the ASGI scope's raw headers. A value with bytes past ASCII (obs-text,
    legal in HTTP: a UTF-8 `X-Title`) is passed on as the bytes it came as (httpx would refuse it as a str)."""
    out: list[tuple[str, str | bytes]] = []
    for raw_name, raw_value in client_headers:
        name = raw_name.decode("latin-1").lower()
        if name in _HOP_BY_HOP or name in _CLIENT_CLAIMS or name.startswith(ROUTER_PREFIX):
            continue
        out.append((name, raw_value.decode("ascii") if raw_value.isascii() else raw_value))
    if client is not None:
        out.append(("x-forwarded-for", client[0]))
    out.append(("x-forwarded-proto", scheme))
    return out


def response_headers(upstream: list[tuple[str, str]]) -> list[tuple[bytes, bytes]]:
    """A replica's response headers as the client gets them (framing is this leg's own)."""
    return [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in upstream
            if k.lower() not in DROP_RESPONSE_HEADERS]


class NoCookies(httpx.Cookies):
    """The forwarding client's cookie jar, which keeps nothing: a replica's Set-Cookie belongs to the client it
    answered, never to the next request; and httpx's cookie handling copies a request's headers into a dict header
    by header (quadratic: 8,000 headers held the event loop 1.7 s)."""

    def extract_cookies(self, response: httpx.Response) -> None:
        return None

    def set_cookie_header(self, request: httpx.Request) -> None:
        return None


def is_admin(client_headers: list[tuple[bytes, bytes]], admin_token: str | None) -> bool:
    """The request carries `Authorization: Bearer <the admin token>` (never true without a token)."""
    if not admin_token:
        return False
    for name, value in client_headers:
        if name.lower() == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            if scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), admin_token.encode()):
                return True
    return False
