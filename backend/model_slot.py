"""One model hosted on an instance (``ModelSlot``: its own vLLM-style scheduler, KV cache
manager, block pool and timing) and the memory arithmetic that sizes it: the per-GPU budget
for weights and KV (``capacity_bytes``) and the most KV blocks a model could use alone
(``pool_blocks``). ``backend.pooling`` time-shares a GPU among such slots."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from backend.block_pool import BlockPool
from backend.kv_manager import KVCacheManager
from backend.request import Request, Status
from backend.scheduler import Scheduler, SchedulerConfig
from protocol.kv_hash import BlockHash
from roofline.profiles import HardwareProfile, ModelProfile
from roofline.timing import TimingModel


@dataclass(slots=True, eq=False)
class ModelSlot:
    """One hosted model: its scheduling state and its share of the instance's memory."""

    name: str
    profile: ModelProfile
    scheduler: Scheduler
    kv: KVCacheManager
    pool: BlockPool
    timing: TimingModel
    block_size: int
    resident: bool = False
    last_active: float = -math.inf
    loads: int = 0
    load_s: float = 0.0
    weight_bytes: float = field(init=False)  # per GPU
    block_bytes: float = field(init=False)  # per GPU

    def __post_init__(self) -> None:
        tp = max(self.profile.tensor_parallel, 1)
        self.weight_bytes = self.profile.weight_bytes / tp
        self.block_bytes = self.profile.kv_bytes_per_token / tp * self.block_size

    @property
    def used_blocks(self) -> int:
        """Blocks requests reference (not free-but-cached ones)."""
        return self.pool.num_blocks - self.pool.num_unreferenced

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def requests(self) -> Iterable[Request]:
        yield from self.scheduler.running
        yield from self.scheduler.waiting

    def oldest_waiting(self) -> float:
        """Arrival of the oldest request that has not started (inf: none)."""
        return min((r.arrival_time for r in self.scheduler.waiting
                    if r.first_token_time is None
                    and r.status is not Status.WAITING_FOR_REMOTE_KVS), default=math.inf)


def new_slot(name: str, profile: ModelProfile, hardware: HardwareProfile, blocks: int,
             root: BlockHash, *, block_size: int = 16, max_num_batched_tokens: int = 8192,
             max_num_seqs: int = 256, enable_caching: bool = True, jitter: float = 0.03,
             seed: int = 0, record_events: bool = True, max_loras: int = 0,
             policy: str = "fcfs") -> ModelSlot:
    """A hosted model with its own block pool, KV cache manager, scheduler and timing."""
    pool = BlockPool(blocks, enable_caching=enable_caching, record_events=record_events)
    kv = KVCacheManager(pool, block_size, root)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens, max_num_seqs, block_size,
                                      max_loras, policy), kv)
    timing = TimingModel(profile, hardware, jitter=jitter, seed=seed)
    return ModelSlot(name, profile, sched, kv, pool, timing, block_size)


def pool_blocks(profile: ModelProfile, capacity_bytes: float, block_size: int) -> int:
    """The most KV blocks the model could use alone on the instance (its pool's size)."""
    tp = max(profile.tensor_parallel, 1)
    free = capacity_bytes - profile.weight_bytes / tp
    return max(0, int(free // (profile.kv_bytes_per_token / tp * block_size)))


def capacity_bytes(hw: HardwareProfile, gpu_memory_utilization: float) -> float:
    """Per-GPU memory for weights and KV, as vLLM budgets it."""
    return hw.memory_bytes * gpu_memory_utilization - hw.activation_reserve_bytes
