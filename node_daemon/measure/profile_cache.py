"""The start-up profile cached on disk, so a restart or a second replica on the same node skips measuring.

A profile is only true for the exact engine that measured it, so the cache file is keyed by everything
that moves iteration time: the model file's identity (path, size, mtime), the device, the model config
(dtype, attention backend, context, and whatever else the config carries), the engine's threads, the
KV block size and ceilings, the sweep's shape, whether the compiled CPU forward ran the profile (a cold start
measures while it compiles in the background: the next start, with it loaded, measures again), and the engine
build (a hash of the engine and model sources, the compiled forward's C++ included, so any code change
re-measures). The file name is a hash of the key and the key is stored
inside too: a file whose stored key differs, or that does not parse, is ignored and re-measured.
Only a profile measured on a quiet machine is written (profiler.py decides, `Profile`'s flags).

Where: --profile-cache-dir, else $STALLFREE_PROFILE_CACHE, else $XDG_CACHE_HOME/stallfree/profiles,
else ~/.cache/stallfree/profiles.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import time
from functools import lru_cache
from pathlib import Path
from typing import Any

from stallfree.contracts import Profile

log = logging.getLogger(__name__)

CACHE_ENV = "STALLFREE_PROFILE_CACHE"
FORMAT = 1  # bump when the cached shape or the measuring method changes


def default_cache_dir() -> Path:
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "stallfree" / "profiles"


@lru_cache(maxsize=1)
def engine_build() -> str:
    """A hash of the sources that decide iteration time (engine, models, kernels, sim backend)."""
    root = Path(__file__).resolve().parents[2]  # the stallfree package
    digest = hashlib.sha256()
    for folder in ("node_daemon/engine", "node_daemon/models", "node_daemon/sim", "kernels"):
        for path in sorted(p for pattern in ("*.py", "*.cpp", "*.h") for p in (root / folder).rglob(pattern)):
            digest.update(str(path.relative_to(root)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def file_identity(source: str | None) -> dict[str, Any] | None:
    """Path, size and mtime of a model file (a folder: of each file in it); None without a file."""
    if not source:
        return None
    path = Path(source)
    try:
        files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.is_file())
        return {"path": str(path.resolve()),
                "files": [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in files]}
    except OSError:
        return {"path": str(path)}


def cache_key(*, device: str, model_config: dict[str, Any], model_file: dict[str, Any] | None, threads: int,
              extra: dict[str, Any]) -> dict[str, Any]:
    return {"format": FORMAT, "engine_build": engine_build(), "device": device, "model": model_config,
            "model_file": model_file, "threads": threads, **extra}


def _digest(key: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:24]


class ProfileCache:
    def __init__(self, directory: Path | str | None = None) -> None:
        self.directory = Path(directory) if directory is not None else default_cache_dir()

    def path_for(self, key: dict[str, Any]) -> Path:
        return self.directory / f"profile-{_digest(key)}.json"

    def load(self, key: dict[str, Any]) -> tuple[Profile | None, str]:
        """The cached profile for this key, or None and why not (missing, corrupt, another key)."""
        path = self.path_for(key)
        if not path.exists():
            return None, f"no cached profile at {path}"
        try:
            data = json.loads(path.read_text())
            # A JSON round trip of the key, so tuples and lists compare alike.
            if data.get("key") != json.loads(json.dumps(key, sort_keys=True, default=str)):
                return None, f"the cached profile at {path} belongs to another engine (key differs)"
            profile = Profile.from_dict(data["profile"])
            if not profile.mixed:
                return None, f"the cached profile at {path} has no mixed points"
        except (OSError, ValueError, KeyError, TypeError) as exc:
            return None, f"the cached profile at {path} is unreadable ({type(exc).__name__}: {exc})"
        return profile, f"cached profile from {path}"

    def store(self, key: dict[str, Any], profile: Profile, notes: dict[str, Any] | None = None) -> Path | None:
        """Write atomically (a concurrent replica reads the old file or the new one, never half)."""
        path = self.path_for(key)
        body = {"key": json.loads(json.dumps(key, sort_keys=True, default=str)), "profile": profile.to_dict(),
                "measured_at": time.time(), **(notes or {})}
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=".profile-", suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                json.dump(body, f, indent=1, sort_keys=True)
            os.replace(tmp, path)
        except OSError as exc:
            log.warning("could not write the profile cache %s: %s", path, exc)
            return None
        return path


def profile_key(engine, device: str, settings) -> dict[str, Any]:
    """The cache key of `engine`'s profile on `device` measured with `settings` (a ProfileSettings)."""
    import dataclasses

    import torch

    config = engine.config
    loaded = getattr(engine.executor, "loaded", None)
    source = getattr(loaded, "source", None) if loaded is not None else None
    model_file = file_identity(source) if getattr(loaded, "source_kind", None) != "random" else None
    runner = getattr(engine.executor, "runner", None)
    compiled = getattr(runner, "cpu_decode", None)
    extra = {
        "backend": config.backend,
        # The compiled CPU forward (models/cpu_decode.py) in use now: iterations about 1.3-1.6x shorter than
        # the Python path's, which serves while it compiles.
        "compiled_forward": compiled is not None and compiled.can_run(1, True),
        "block_size": engine.kv_cache.block_size,
        "ceilings": dataclasses.asdict(engine.ceilings),
        "max_model_len": engine.max_model_len,
        "loaded_dtype": str(getattr(loaded, "dtype", "")) if loaded is not None else None,
        "sweep": {"decode_context": settings.decode_context,
                  "mixed_decodes": settings.mixed_decodes, "max_tokens": settings.max_tokens,
                  "max_decodes": settings.max_decodes},
    }
    return cache_key(device=device, model_config=dataclasses.asdict(config.model), model_file=model_file,
                     threads=torch.get_num_threads(), extra=extra)
