"""Bearer tokens: the admin token guards /admin/*, an optional API key guards the inference endpoints.

Tokens come from a file (a mounted Kubernetes Secret) or an environment variable; comparison is constant
time. Without an admin token the admin API is closed, not open: the operator always renders one. A file is
followed: the kubelet rewrites a mounted Secret in place when it is made anew (the operator repairs a deleted one
with a fresh token), so the daemon must not hold the old token until it restarts.
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


class SecretFile:
    """A secret read from a file, read again when the file changes (checked with one stat per use)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._stamp: tuple[int, int, int] | None = None
        self._value = ""
        self.current()  # an unreadable or empty file is a start-up error, not a first-request one

    def current(self) -> str:
        try:
            stat = os.stat(self.path)
        except OSError as exc:
            if self._stamp is None:
                raise ValueError(f"cannot read secret file {self.path}: {exc.strerror}") from None
            return self._value  # mid-swap (the kubelet replaces a symlink): keep the last good value
        stamp = (stat.st_ino, stat.st_mtime_ns, stat.st_size)
        if stamp != self._stamp:
            value = load_secret(self.path, "") if self._stamp is None else _read_or_none(self.path)
            if value:
                self._value, self._stamp = value, stamp
        return self._value


def _read_or_none(path: str) -> str | None:
    try:
        return Path(path).read_text().strip() or None
    except OSError:
        return None


def watched_secret(path: str | None, env_var: str) -> SecretFile | str | None:
    """A file's secret, followed as it changes; else the environment variable's (fixed for the process)."""
    return SecretFile(path) if path else load_secret(None, env_var)


def _value(secret: SecretFile | str | None) -> str | None:
    return secret.current() if isinstance(secret, SecretFile) else secret


def _bearer(request: Request) -> str | None:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def _matches(given: str | None, expected: str) -> bool:
    return given is not None and hmac.compare_digest(given.encode(), expected.encode())


class Auth:
    def __init__(self, admin_token: SecretFile | str | None, api_key: SecretFile | str | None = None) -> None:
        self._admin_token = admin_token
        self._api_key = api_key

    @property
    def admin_token(self) -> str | None:
        return _value(self._admin_token)

    @property
    def api_key(self) -> str | None:
        return _value(self._api_key)

    def check_admin(self, request: Request) -> None:
        admin_token = self.admin_token
        if admin_token is None:
            raise APIError(403, "the admin API is disabled: start the daemon with --admin-token-file or "
                           f"{ADMIN_TOKEN_ENV}", code="admin_disabled", reason="unauthorized")
        if not _matches(_bearer(request), admin_token):
            raise APIError(401, "admin endpoints need 'Authorization: Bearer <admin token>'",
                           code="invalid_admin_token", reason="unauthorized",
                           headers={"WWW-Authenticate": "Bearer"})

    def check_api_key(self, request: Request) -> None:
        api_key = self.api_key
        if api_key is None:
            return
        if not _matches(_bearer(request), api_key):
            raise APIError(401, "invalid or missing API key: send 'Authorization: Bearer <key>'",
                           code="invalid_api_key", reason="unauthorized", headers={"WWW-Authenticate": "Bearer"})
