"""Bearer tokens: the admin token guards /admin/*, an optional API key guards the inference endpoints.

Tokens come from a file (a mounted Kubernetes Secret) or an environment variable; comparison is constant
time. Without an admin token the admin API is closed, not open: the operator always renders one.
"""
from __future__ import annotations

import hmac
import os
from pathlib import Path

from starlette.requests import Request

from stallfree.node_daemon.server.errors import APIError

ADMIN_TOKEN_ENV = "STALLFREE_ADMIN_TOKEN"
API_KEY_ENV = "STALLFREE_API_KEY"


def load_secret(path: str | None, env_var: str) -> str | None:
    """The secret in `path` (stripped) if given, else the environment variable; empty counts as unset."""
    if path:
        try:
            value = Path(path).read_text().strip()
        except OSError as exc:
            raise ValueError(f"cannot read secret file {path}: {exc.strerror}") from None
        if not value:
            raise ValueError(f"secret file {path} is empty")
        return value
    return os.environ.get(env_var) or None


def _bearer(request: Request) -> str | None:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def _matches(given: str | None, expected: str) -> bool:
    return given is not None and hmac.compare_digest(given.encode(), expected.encode())


class Auth:
    def __init__(self, admin_token: str | None, api_key: str | None = None) -> None:
        self.admin_token = admin_token
        self.api_key = api_key

    def check_admin(self, request: Request) -> None:
        if self.admin_token is None:
            raise APIError(403, "the admin API is disabled: start the daemon with --admin-token-file or "
                           f"{ADMIN_TOKEN_ENV}", code="admin_disabled", reason="unauthorized")
        if not _matches(_bearer(request), self.admin_token):
            raise APIError(401, "admin endpoints need 'Authorization: Bearer <admin token>'",
                           code="invalid_admin_token", reason="unauthorized",
                           headers={"WWW-Authenticate": "Bearer"})

    def check_api_key(self, request: Request) -> None:
        if self.api_key is None:
            return
        if not _matches(_bearer(request), self.api_key):
            raise APIError(401, "invalid or missing API key: send 'Authorization: Bearer <key>'",
                           code="invalid_api_key", reason="unauthorized", headers={"WWW-Authenticate": "Bearer"})
