"""Engine configuration: what a daemon is started with (ceilings) and where its live knobs begin."""
from __future__ import annotations

from dataclasses import dataclass, field

from stallfree.contracts import Ceilings, Tuning
from stallfree.node_daemon.engine.speculation import SpeculativeConfig
from stallfree.node_daemon.models.config import ModelConfig


@dataclass
class SchedulerConfig:
    ceilings: Ceilings = field(default_factory=Ceilings)
    tuning: Tuning = field(default_factory=Tuning)
    # KV blocks kept free at admission so running decodes can grow without preempting at once.
    watermark_blocks: int = 0
    max_model_len: int = 2048
    # n-gram drafts verified inside the token budget (speculation.py); off unless asked for.
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)


@dataclass
class CacheConfig:
    block_size: int = 16
    num_blocks: int = 0  # 0: size from memory (kv_memory_fraction of free device memory, or a CPU default)
    kv_memory_fraction: float = 0.9
    enable_prefix_caching: bool = True


@dataclass
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    backend: str = "model"  # model | sim
