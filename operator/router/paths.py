"""Which requests the router serves (pure): the OpenAI API and its own endpoints, by exact, normalised path.

The path a replica sees is built here from the route, never copied from the client: `/v1/%2e%2e/admin/...`
arrives decoded as `/v1/../admin/...`, and a path with a dot segment, an empty segment (`//`), a trailing
slash, a backslash or a control character is no path the router serves (404), so the admin API is never
reachable through it. The query string is not forwarded (no OpenAI route the router serves reads one).
"""
from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import quote

# OpenAI's routes a daemon serves, and the methods of each.
OPENAI_ROUTES = {"/v1/completions": ("POST",), "/v1/chat/completions": ("POST",), "/v1/models": ("GET",)}
MODEL_ROUTE = "/v1/models/"  # + a model id, which may itself hold slashes ("meta-llama/Llama-3-8B")
OWN_ROUTES = {"/health": ("GET",), "/ready": ("GET",), "/metrics": ("GET",),
              "/router/replicas": ("GET",), "/router/queue": ("GET",)}


@dataclass(frozen=True)
class Route:
    kind: str  # "openai" (sent to a replica), "own" (the router answers), "method" (known path, wrong method)
    path: str  # the path to send upstream ("openai"), or the router's own path
    methods: tuple[str, ...] = ()


def is_canonical(path: str) -> bool:
    """An absolute path with no empty or dot segment, no trailing slash, backslash or control character."""
    if not path.startswith("/") or "\\" in path or any(ord(c) < 0x20 or ord(c) == 0x7F for c in path):
        return False
    if path == "/":
        return True
    return all(segment not in ("", ".", "..") for segment in path[1:].split("/"))


def route(method: str, path: str) -> Route | None:
    """The route `method path` (the decoded path) takes, or None: not a path the router serves (404)."""
    if not is_canonical(path):
        return None
    for table, kind in ((OPENAI_ROUTES, "openai"), (OWN_ROUTES, "own")):
        methods = table.get(path)
        if methods is not None:
            return Route(kind, path, methods) if method in methods else Route("method", path, methods)
    if path.startswith(MODEL_ROUTE) and len(path) > len(MODEL_ROUTE):
        methods = ("GET",)
        upstream = MODEL_ROUTE + quote(path[len(MODEL_ROUTE):], safe="/")
        return Route("openai", upstream, methods) if method in methods else Route("method", path, methods)
    return None
