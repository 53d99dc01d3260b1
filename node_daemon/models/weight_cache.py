"""A GGUF model's tensors as the CPU serves them, kept on disk after the first load and mapped at later starts.

Loading SmolLM2's GGUF decodes 4-bit blocks and lays them out again for the code kernel: 2.5 s of a start on a busy
2-core machine. The result (every parameter held, and every coded weight's tiles; torch's int4 pack is made from
the tiles if the Python path ever needs it) is written once as a safetensors file; later starts map it privately
and serve from the mapping (pages read as first touched, shared with the page cache; nothing copied). With the
dense weights released (a daemon) it holds the tiles and norms alone: about the GGUF file's size. The file's key is the GGUF file's identity
(path, size, mtime), the dtype, whether dense copies of the coded projections are kept, torch's version and CPU
capability, the tier, FORMAT and the source of the modules that decide the tensors' values, so a change in any of
them is a new file. $STALLFREE_WEIGHT_CACHE is the folder (0/off: no cache), else $XDG_CACHE_HOME/stallfree/weights.
So that upgrades, tiers and dtypes (each a new key) never fill the disk, a write keeps KEEP_PER_MODEL files of that
GGUF file name, the most recently used (a load marks its file used), and removes the rest.
"""
from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from stallfree.node_daemon.models.quantized import Int4Weight, TiledCodes

if TYPE_CHECKING:
    from stallfree.node_daemon.models.llama import LlamaForCausalLM

log = logging.getLogger(__name__)

ENV = "STALLFREE_WEIGHT_CACHE"
FORMAT = 8  # 3: the code kernel's tiles on every tier (TiledCodes); 4: the tiles alone (torch's int4 pack made at use),
# and no dense copy of a projection that its codes alone serve; 5: nor of a tied embedding (looked up in its codes),
# nor of a projection with a oneDNN copy (made from the codes at load); 6: Q4_K/Q5_K in super-block records; 7: Q6_K
# in its own 6-bit records (AVX512-VNNI); 8: Q3_K in its own 3-bit records (AVX512-VNNI), and a fused q/k/v's v of
# another type in records of its own (TiledCodes.tail)
_VALUE_SOURCES = ("gguf_loader.py", "gguf_file.py", "quantized.py", "kquant_codes.py", "kquant_tiles.py",
                  "small_block_codes.py", "llama.py", "gguf_tiles.py", "cpu_gguf_tiles.h")
_TIED_HEAD = "tied_lm_head_int4"
_DIGEST_CHARS = 20
# Cache files kept per GGUF file name, the one just written among them (a daemon's native tier, a forced AVX2 tier
# and one more); a process mapping a removed file keeps its pages (only the name goes).
KEEP_PER_MODEL = 3


def cache_folder() -> Path | None:
    """The folder of per-GGUF-file caches: $STALLFREE_WEIGHT_CACHE, else $XDG_CACHE_HOME/stallfree/weights; None
    when it is 0/off (no cache)."""
    setting = os.environ.get(ENV, "")
    if setting.lower() in ("0", "off", "no", "false"):
        return None
    return Path(setting) if setting else \
        Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "stallfree" / "weights"


def cache_file(gguf_path: str, dtype: torch.dtype, dense: bool = True) -> Path | None:
    """Where this GGUF file's tensors in `dtype` are (or would be) cached; None when the cache is off."""
    root = cache_folder()
    if root is None:
        return None
    stat = os.stat(gguf_path)
    # torch's int4 packing lays its codes out for the vector width its kernels run at (ATen's CPU capability), so a
    # pack made at one tier is garbage at another: the capability and the tier are part of the key.
    from stallfree.node_daemon.models.cpu_tier import cpu_tier

    digest = hashlib.sha256(json.dumps([FORMAT, os.path.abspath(gguf_path), stat.st_size, stat.st_mtime_ns,
                                        str(dtype), torch.__version__, torch.backends.cpu.get_cpu_capability(),
                                        cpu_tier().name, dense]).encode())
    here = Path(__file__).parent
    for name in _VALUE_SOURCES:
        digest.update((here / name).read_bytes())
    return root / f"{Path(gguf_path).stem}-{digest.hexdigest()[:_DIGEST_CHARS]}.safetensors"


def _int4_weights(model: "LlamaForCausalLM") -> dict[str, Int4Weight]:
    found = {name: m.int4 for name, m in model.named_modules() if getattr(m, "int4", None) is not None}
    if model.tied_lm_head_int4 is not None:
        found[_TIED_HEAD] = model.tied_lm_head_int4
    return found


def save(model: "LlamaForCausalLM", path: Path, background: bool = False) -> bool:
    """Write every parameter held (a projection its codes alone serve holds none) and every weight's tiles
    (atomically: a reader never sees half a file). False on an OS error.

    `background`: the tensors are gathered here and written by a thread (a fresh start serves 0.4 s sooner; the
    process waits for it at exit, and flush() waits for it); True then."""
    tensors = {name: p.detach().contiguous() for name, p in model.named_parameters() if p.device.type != "meta"}
    planes, bits, tail_bits = {}, {}, {}
    for name, w in _int4_weights(model).items():
        planes[name] = w.planes
        tensors[f"{name}.tiles.blocks"], bits[name] = w.tiles.blocks, w.tiles.bits
        if w.tiles.tail is not None:  # rows in records of their own kind (TiledCodes.tail)
            tensors[f"{name}.tiles.tail.blocks"], tail_bits[name] = w.tiles.tail.blocks, w.tiles.tail.bits
    metadata = {"planes": json.dumps(planes), "tile_bits": json.dumps(bits), "tail_bits": json.dumps(tail_bits),
                "format": str(FORMAT)}
    if not background:
        return _write(tensors, metadata, path)
    thread = threading.Thread(target=_write, args=(tensors, metadata, path), name="weight-cache-write")
    _writers.append(thread)
    thread.start()
    return True


def flush() -> None:
    """Wait for the weight cache files being written in the background."""
    while _writers:
        _writers.pop().join()


_writers: list[threading.Thread] = []


def _write(tensors: dict[str, torch.Tensor], metadata: dict[str, str], path: Path) -> bool:
    from safetensors.torch import save_file

    started = time.monotonic()
    tmp = path.with_suffix(f".tmp{os.getpid()}-{threading.get_ident()}")  # two writers never share one
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(tmp), metadata=metadata)
        os.replace(tmp, path)
    except OSError as exc:
        log.warning("weight cache: not written (%s)", exc)
        tmp.unlink(missing_ok=True)
        return False
    log.info("weight cache: wrote %s (%.0f MiB) in %.2f s", path, path.stat().st_size / 2**20,
             time.monotonic() - started)
    prune(path)
    return True


def prune(kept: Path) -> list[Path]:
    """Remove the cache files of `kept`'s GGUF file name past the KEEP_PER_MODEL most recently used (`kept`
    always stays); the files removed."""
    stem = kept.name[:-len(f"-{'0' * _DIGEST_CHARS}.safetensors")]
    pattern = f"{glob.escape(stem)}-{'?' * _DIGEST_CHARS}.safetensors"
    try:
        others = sorted((p for p in kept.parent.glob(pattern) if p != kept), key=lambda p: p.stat().st_mtime,
                        reverse=True)
    except OSError:  # a file removed while listed (another process pruning)
        return []
    removed = []
    for old in others[KEEP_PER_MODEL - 1:]:
        try:
            old.unlink()
            removed.append(old)
        except OSError:
            pass
    if removed:
        log.info("weight cache: removed %d older file(s) of %s (kept the %d most recently used)", len(removed), stem,
                 KEEP_PER_MODEL)
    return removed


_SAFETENSORS_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "U8": torch.uint8,
                       "I8": torch.int8, "I32": torch.int32, "I64": torch.int64}


def mapped_tensors(path: Path) -> dict[str, torch.Tensor]:
    """A safetensors file's tensors as views of one private (copy-on-write) mapping of it: safetensors' own
    loader copies each tensor into fresh memory, which doubled a cached start's peak RSS."""
    import mmap
    import warnings

    with open(path, "rb") as f:
        mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    header_len = int.from_bytes(mapping[:8], "little")
    header = json.loads(mapping[8:8 + header_len])
    start = 8 + header_len
    tensors = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # frombuffer's note on non-resizable buffers
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            dtype = _SAFETENSORS_DTYPES.get(entry["dtype"])
            if dtype is None:
                raise ValueError(f"tensor {name}: dtype {entry['dtype']} is not one the cache writes")
            begin, end = entry["data_offsets"]
            count = (end - begin) // torch.empty(0, dtype=dtype).element_size()
            flat = torch.frombuffer(mapping, dtype=dtype, count=count, offset=start + begin) if count else \
                torch.empty(0, dtype=dtype)
            tensors[name] = flat.view(entry["shape"])
    return tensors


def load(model: "LlamaForCausalLM", path: Path) -> bool:
    """Fill `model` from the cached file (its tensors become the parameters: no copy); False, model untouched,
    when the file does not hold what this model needs."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata()
            planes = json.loads(metadata.get("planes", "{}"))
            bits = json.loads(metadata.get("tile_bits", "{}"))
            tail_bits = json.loads(metadata.get("tail_bits", "{}"))
        tensors = mapped_tensors(path)
    except (OSError, ValueError, RuntimeError, SafetensorError) as exc:
        log.warning("weight cache: %s unreadable (%s): loading the GGUF file", path, exc)
        return False
    params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    # A projection served from its codes alone was saved without its dense weight: it comes back released.
    codes_only = {f"{n}.weight" for n in planes if n != _TIED_HEAD and f"{n}.weight" not in tensors}
    # An embedding looked up in the tied head's codes was saved without its table (release_dense_embedding).
    embed_from_codes = _TIED_HEAD in planes and "embed_tokens.weight" not in tensors
    absent = codes_only | ({"embed_tokens.weight"} if embed_from_codes else set())
    if any(name not in absent and (name not in tensors or tensors[name].shape != p.shape
                                       or tensors[name].dtype != p.dtype) for name, p in params.items()) \
            or any(f"{n}.tiles.blocks" not in tensors for n in planes) or set(bits) != set(planes) \
            or any(f"{n}.tiles.tail.blocks" not in tensors for n in tail_bits):
        log.warning("weight cache: %s does not match this model: loading the GGUF file", path)
        return False
    # Every tensor stays a view of the file's private mapping: nothing is copied, pages are read as first touched
    # (and shared with the page cache: a restart finds them there), and the load never holds a tensor twice.
    for name, p in params.items():
        if name not in absent:
            p.data = tensors[name]
    for name, count in planes.items():
        tail = TiledCodes(tensors[f"{name}.tiles.tail.blocks"], tail_bits[name]) if name in tail_bits else None
        tiles = TiledCodes(tensors[f"{name}.tiles.blocks"], bits[name], tail)
        weight = Int4Weight.from_tiles(tiles, count, model.dtype)
        if name == _TIED_HEAD:
            model.tied_lm_head_int4 = weight
        else:
            modules[name].int4 = weight
    if codes_only:
        model.release_coded_dense_weights()
    if embed_from_codes:
        model.release_dense_embedding()
    try:
        os.utime(path)  # used: the last to be pruned
    except OSError:
        pass
    return True
