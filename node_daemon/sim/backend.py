"""What `serve --backend sim` and the simulators build: shape, cost model, KV capacity, executor, tokenizer.

One place turns (model, hardware, dtype, overrides) into the sim's parts, so the daemon, `simulate` and
VirtualReplica agree on what "mistral-7b on an a100" means.
"""
from __future__ import annotations

import functools
from pathlib import Path

from stallfree.shapes import ModelShape, get_shape
from stallfree.node_daemon.sim.cost_model import RooflineCostModel, dtype_bytes
from stallfree.node_daemon.sim.hardware import Hardware, get_hardware, with_figures
from stallfree.node_daemon.sim.sim_executor import SimExecutor, VirtualClock

# Below this many KV blocks a simulated replica is mis-sized, whatever the memory figures say.
_MIN_SIM_BLOCKS = 16


def resolve_shape(model: str) -> ModelShape:
    """A named shape, or a Hugging Face folder's config.json (no weights are read)."""
    path = Path(model)
    if path.is_dir() and (path / "config.json").is_file():
        from stallfree.node_daemon.models.hf_loader import hf_shape, read_config

        return hf_shape(read_config(str(path)), path.name)
    return get_shape(model)


def build_cost_model(model: str | ModelShape, hardware: str | Hardware = "h100", dtype: str = "bfloat16",
                     tflops: float | None = None, hbm_tbps: float | None = None,
                     overhead_ms: float | None = None) -> RooflineCostModel:
    """The roofline for a model on a hardware preset (or a Hardware), any figure overridden by hand
    (a FLOP rate or bandwidth given is the achieved figure: hardware.with_figures)."""
    shape = model if isinstance(model, ModelShape) else resolve_shape(model)
    if isinstance(hardware, Hardware):
        hw = with_figures(hardware, tflops=tflops, hbm_tbps=hbm_tbps, overhead_ms=overhead_ms)
    else:
        hw = get_hardware(hardware, tflops=tflops, hbm_tbps=hbm_tbps, overhead_ms=overhead_ms)
    return RooflineCostModel(shape, hw, weight_dtype_bytes=dtype_bytes(dtype))


def sim_num_kv_blocks(cost_model: RooflineCostModel, block_size: int, kv_memory_fraction: float = 0.9) -> int:
    """KV blocks that fit in `kv_memory_fraction` of device memory after the weights (vLLM's sizing)."""
    if not 0.0 < kv_memory_fraction <= 1.0:
        raise ValueError(f"kv_memory_fraction must be in (0, 1], got {kv_memory_fraction}")
    free = cost_model.hardware.memory_gib * (1 << 30) * kv_memory_fraction - cost_model.weight_bytes
    blocks = int(free // (block_size * cost_model.kv_bytes_per_token))
    if blocks < _MIN_SIM_BLOCKS:
        raise ValueError(
            f"{cost_model.shape.name} does not fit on {cost_model.hardware.name} "
            f"({cost_model.hardware.memory_gib:g} GiB): only {max(0, blocks)} KV blocks would remain"
        )
    return blocks


def build_sim_executor(cost_model: RooflineCostModel, virtual: bool = False, eos_token_id: int | None = None,
                       eos_after: int | None = None) -> SimExecutor:
    """Real time (sleeps) for serving; virtual time for simulations.

    The vocabulary is the model's: prompts may hold any of its ids. The placeholder tokens it samples
    are bytes, which stay bytes under that modulus.
    """
    return SimExecutor(cost_model, clock=VirtualClock() if virtual else None,
                       vocab_size=cost_model.shape.vocab_size, eos_token_id=eos_token_id,
                       eos_after=eos_after)


def sim_tokenizer(model: str | ModelShape | int):
    """A byte-level tokenizer sized to the shape's vocab (or a vocab size): placeholder tokens are bytes,
    so the API returns text. One per vocab size per process: the simulator builds many replicas."""
    if isinstance(model, int):
        return _byte_level_tokenizer(model)
    shape = model if isinstance(model, ModelShape) else resolve_shape(model)
    return _byte_level_tokenizer(shape.vocab_size)


@functools.lru_cache(maxsize=8)
def _byte_level_tokenizer(vocab_size: int):
    from stallfree.node_daemon.text.tokenizer import byte_level_tokenizer

    return byte_level_tokenizer(vocab_size)
