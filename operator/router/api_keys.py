"""API keys: who a request is, from the key it presents (`Authorization: Bearer <key>`, as OpenAI's clients send).

The keys file (`--api-keys-file`: a Secret the InferenceService names, mounted as a file) holds only hashes, so a
copy of it, a log line or a heap dump gives no usable key:

    {"keys": [{"sha256": "<hex of sha256(key)>", "tenant": "team-a", "objectives": ["interactive", "batch"]},
              {"sha256": "...", "tenant": "nightly", "objectives": ["batch"]}]}

`objectives` lists the objectives the tenant may name (absent or "*": all of them). Several keys may map to one
tenant (rotation: add the new key, move the clients, remove the old one). The file is read again whenever it
changes (Kubernetes swaps a mounted Secret's files in place), so keys rotate without a restart; a file that no
longer reads leaves the last good keys in force and is logged. The lookup hashes the presented key and finds the
hash in a dict: nothing about a stored key is compared byte by byte.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass

log = logging.getLogger("stallfree.router")

MAX_TENANT_CHARS = 128
MAX_KEY_CHARS = 512  # a presented key longer than this is not one of ours (never hashed)


@dataclass(frozen=True)
class KeyHolder:
    tenant: str
    objectives: frozenset[str] | None  # None: every objective of the service


def hash_key(key: str) -> str:
    """What the keys file stores for `key`: the hex SHA-256 of its UTF-8 bytes (`printf %s KEY | sha256sum`)."""
    return hashlib.sha256(key.encode()).hexdigest()


def parse_keys(text: str) -> dict[str, KeyHolder]:
    """The keys file's content -> {sha256 hex: holder}; ValueError naming the problem."""
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"the API keys file is not JSON: {exc}") from None
    entries = data.get("keys") if isinstance(data, dict) else None
    if not isinstance(entries, list):
        raise ValueError('the API keys file must be {"keys": [{"sha256", "tenant", "objectives"}, ...]}')
    out: dict[str, KeyHolder] = {}
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict):
            raise ValueError(f"keys[{i}] must be an object")
        digest, tenant = entry.get("sha256"), entry.get("tenant")
        if not isinstance(digest, str) or len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest.lower()):
            raise ValueError(f"keys[{i}].sha256 must be the 64 hex digits of a key's SHA-256 (never the key itself)")
        if not isinstance(tenant, str) or not 0 < len(tenant) <= MAX_TENANT_CHARS or not tenant.isprintable():
            raise ValueError(f"keys[{i}].tenant must be a printable name of 1 to {MAX_TENANT_CHARS} characters")
        objectives = entry.get("objectives", "*")
        if objectives == "*":
            allowed = None
        elif isinstance(objectives, list) and objectives and all(isinstance(o, str) and o for o in objectives):
            allowed = frozenset(objectives)
        else:
            raise ValueError(f'keys[{i}].objectives must be "*" or a non-empty list of objective names')
        if digest.lower() in out:
            raise ValueError(f"keys[{i}]: the same key hash is listed twice")
        out[digest.lower()] = KeyHolder(tenant, allowed)
    return out


class KeyBook:
    """The keys of one file, read again when the file changes (checked at most every `recheck_s`)."""

    def __init__(self, path: str, recheck_s: float = 1.0) -> None:
        self.path = path
        self.recheck_s = recheck_s
        self.reloads = 0
        self.failed_reloads = 0
        self._keys: dict[str, KeyHolder] = {}
        self._seen: tuple[int, int, int] | None = None
        self._checked_at = float("-inf")
        self._load(initial=True)

    def holder(self, key: str, now_s: float) -> KeyHolder | None:
        """The tenant and objectives of `key`; None when it is no key of this file."""
        if now_s - self._checked_at >= self.recheck_s:
            self._checked_at = now_s
            self._load()
        if not key or len(key) > MAX_KEY_CHARS:
            return None
        return self._keys.get(hash_key(key))

    def __len__(self) -> int:
        return len(self._keys)

    def _load(self, initial: bool = False) -> None:
        seen = None
        try:
            st = os.stat(self.path)  # follows the Secret volume's ..data symlink: a swap changes inode and mtime
            seen = (st.st_ino, st.st_mtime_ns, st.st_size)
            if seen == self._seen:
                return
            with open(self.path, encoding="utf-8") as f:
                keys = parse_keys(f.read())
        except (OSError, ValueError) as exc:
            if initial:
                raise ValueError(f"--api-keys-file {self.path}: {exc}") from None
            self.failed_reloads += 1
            self._seen = seen or self._seen  # this version is not read again: the next change is
            log.error("API keys file %s no longer reads (%s): the last good keys stay in force", self.path, exc)
            return
        self._keys, self._seen = keys, seen
        if not initial:
            self.reloads += 1
            log.info("API keys file %s read again: %d key(s)", self.path, len(keys))
