"""How an engine is configured, and the models it hosts built into a ``Multiplexer``."""

from __future__ import annotations

from dataclasses import dataclass

from backend.model_slot import ModelSlot, capacity_bytes, new_slot, pool_blocks
from backend.pooling import Multiplexer, PoolingConfig
from protocol.kv_hash import BlockHash, root_hash
from roofline.profiles import HardwareProfile, ModelProfile


@dataclass(slots=True)
class EngineConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks: int | None = None  # overrides the memory-derived size
    enable_prefix_caching: bool = True
    time_scale: float = 1.0
    jitter: float = 0.03
    seed: int = 0
    kv_hold_timeout_s: float = 480.0
    resync_s: float = 0.010
    max_loras: int = 0  # distinct LoRA adapters per batch (0: no limit)
    scheduling_policy: str = "fcfs"  # fcfs | priority (a request's ``priority``, lower first)


def num_gpu_blocks(model: ModelProfile, hw: HardwareProfile, cfg: EngineConfig) -> int:
    """KV blocks that fit per GPU after weights and activations, as vLLM sizes its cache."""
    return pool_blocks(model, capacity_bytes(hw, cfg.gpu_memory_utilization), cfg.block_size)


def multiplexer(model: ModelProfile, hardware: HardwareProfile, cfg: EngineConfig,
                pooling: PoolingConfig | None, hosted: dict[str, ModelProfile]
                ) -> Multiplexer:
    """One slot per hosted model (``hosted``: served name -> profile, in ``pooling``'s
    order); without ``pooling`` the one model, dedicated."""
    if pooling is None:
        blocks = cfg.num_gpu_blocks or num_gpu_blocks(model, hardware, cfg)
        if blocks <= 0:
            raise ValueError(f"model {model.name} does not fit on "
                             f"{hardware.name} at gpu_memory_utilization="
                             f"{cfg.gpu_memory_utilization}")
        slot = _slot(hardware, cfg, model.name, model, blocks, root_hash(model.name))
        return Multiplexer([slot], mode="dedicated", hardware=hardware,
                           capacity=capacity_bytes(hardware, cfg.gpu_memory_utilization))
    cap = capacity_bytes(hardware, cfg.gpu_memory_utilization)
    slots = []
    for name, _ in pooling.models:
        profile = hosted[name]
        blocks = pool_blocks(profile, cap, cfg.block_size)
        if blocks <= 0:
            raise ValueError(f"model {name} ({profile.name}) does not fit on "
                             f"{hardware.name}")
        slots.append(_slot(hardware, cfg, name, profile, blocks, root_hash(name)))
    return Multiplexer(slots, mode=pooling.mode, hardware=hardware, capacity=cap,
                       switch=pooling.switch, ttft_slo_s=pooling.ttft_slo_s,
                       tpot_slo_s=pooling.tpot_slo_s, time_scale=cfg.time_scale)


def _slot(hardware: HardwareProfile, cfg: EngineConfig, name: str, profile: ModelProfile,
          blocks: int, root: BlockHash) -> ModelSlot:
    return new_slot(name, profile, hardware, blocks, root, block_size=cfg.block_size,
                    max_num_batched_tokens=cfg.max_num_batched_tokens,
                    max_num_seqs=cfg.max_num_seqs, enable_caching=cfg.enable_prefix_caching,
                    jitter=cfg.jitter, seed=cfg.seed, max_loras=cfg.max_loras,
                    policy=cfg.scheduling_policy)
