"""A GGUF file's tokenizer, built once from its metadata and kept beside the weight cache.

Building the tokenizer a GGUF file describes (llama.cpp's SPM pieces as a byte-fallback BPE: every split of every
piece tried as a merge) takes seconds for a large vocabulary (Gemma 3's 262k pieces: 5 s of a start on a busy
2-core machine); reading back the tokenizers library's own JSON of the result takes a fraction of that. The file's
key is the GGUF file's identity (path, size, mtime), the tokenizers version and the source of the modules that
build it. The folder is the weight cache's ($STALLFREE_WEIGHT_CACHE; 0/off: no cache).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Callable

import tokenizers
from tokenizers import Tokenizer as HFTokenizer

log = logging.getLogger(__name__)

ENV = "STALLFREE_WEIGHT_CACHE"


def cache_folder() -> Path | None:
    """The folder of per-GGUF-file caches (this tokenizer's, models/weight_cache.py's tensors): $STALLFREE_WEIGHT_CACHE,
    else $XDG_CACHE_HOME/stallfree/weights; None when it is 0/off (no cache)."""
    setting = os.environ.get(ENV, "")
    if setting.lower() in ("0", "off", "no", "false"):
        return None
    return Path(setting) if setting else \
        Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "stallfree" / "weights"


def read_cached_backend(gguf_path: str) -> HFTokenizer | None:
    """This GGUF file's tokenizer from the cache; None when it is not there (or unreadable: built again)."""
    path = cache_file(gguf_path)
    if path is not None and path.exists():
        try:
            return HFTokenizer.from_file(str(path))
        except Exception as exc:  # noqa: BLE001 - a damaged file is rebuilt, never a failed start
            log.warning("tokenizer cache: %s unreadable (%s): building the tokenizer again", path, exc)
    return None


def cached_backend(gguf_path: str, build: Callable[[], HFTokenizer]) -> HFTokenizer:
    """The tokenizer `build()` makes for this GGUF file: read from the cache when there, else built and written."""
    cached = read_cached_backend(gguf_path)
    if cached is not None:
        return cached
    path = cache_file(gguf_path)
    backend = build()
    if path is not None:
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            backend.save(str(tmp), pretty=False)  # compact: 14 MB for Gemma 3 where indented is 33, read 10% faster
            os.replace(tmp, path)
        except OSError as exc:
            log.warning("tokenizer cache: not written (%s)", exc)
            tmp.unlink(missing_ok=True)
    return backend


def cache_file(gguf_path: str) -> Path | None:
    """Where this GGUF file's tokenizer is cached (None: the cache is off, or the path is no file)."""
    root = cache_folder()
    if root is None or not os.path.isfile(gguf_path):
        return None
    stat = os.stat(gguf_path)
    digest = hashlib.sha256(json.dumps([os.path.abspath(gguf_path), stat.st_size, stat.st_mtime_ns,
                                        tokenizers.__version__]).encode())
    here = Path(__file__).parent
    for name in ("tokenizer.py", "tokenizer_cache.py"):
        digest.update((here / name).read_bytes())
    return root / f"{Path(gguf_path).stem}-{digest.hexdigest()[:20]}.tokenizer.json"
