"""KV tiers below GPU memory: the instance's host memory and a shared pool (Mooncake Store,
LMCache's remote backend), their lookup order and what a load costs.

*Lookup* (``TierWalk.plan``): after the GPU prefix cache's hit, the prompt's next blocks are
looked up in host memory, then in the pool, and the walk stops at the first block no tier
holds: a prefix is only usable up to its first hole. At most ``num_tokens - 1`` tokens are
taken from any tier, as on GPU (the last token is computed to sample from it).

*Stores* are write-through: every block registered in the GPU prefix cache is copied to host
memory and put into the pool as soon as it is computed, the way vLLM's offloading connector
and LMCache store (asynchronously, after the step that computed it). Writing back only at
eviction would have to finish the copy before the block is reused, stalling the allocation
that evicts it; storing on compute costs device-to-host bandwidth that a step does not use
(PCIe is full duplex, loads go host-to-device), so stores are not charged to the timeline.
Host memory is an LRU of blocks (inclusive of what GPU memory holds); a hit refreshes it.

*Loads* are asynchronous, overlapped with compute as vLLM's KV connectors load: a request
whose prefix is found in a lower tier waits (``WAITING_FOR_REMOTE_KVS``) while its blocks
arrive, and the steps of every other request go on meanwhile. A load takes
``host tokens × bytes per token per GPU ÷ PCIe bandwidth`` (each tensor-parallel rank loads
its shard over its own link) plus, for the pool, ``latency + pool tokens × bytes per token ÷
link bandwidth`` (the same arithmetic as a prefill/decode KV pull); the two legs are
sequential, as a fetch from the pool lands in host memory before it crosses PCIe.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

from backend.block_pool import KVEvent
from protocol.kv_hash import BlockHash
from roofline.profiles import HardwareProfile, ModelProfile

CPU = "CPU"
POOL = "POOL"


@dataclass(slots=True)
class TierStats:
    """Counters of one tier (the backend's ``tokengate_backend_kv_tier_*`` metrics)."""

    hit_tokens: int = 0
    loads: int = 0
    loaded_bytes: float = 0.0
    stored_blocks: int = 0
    evicted_blocks: int = 0

    def count_load(self, tokens: int, nbytes: float) -> None:
        """A load of ``tokens`` tokens (``nbytes`` of KV) from this tier, if any."""
        if tokens:
            self.loads += 1
            self.hit_tokens += tokens
            self.loaded_bytes += nbytes


@dataclass(frozen=True, slots=True)
class LoadCost:
    """What moving KV into GPU memory costs, from the model and hardware profiles."""

    kv_bytes_per_token: float  # the whole model's, all layers and ranks
    tensor_parallel: int = 1
    pcie_bytes_per_s: float = 50e9  # per GPU
    link_bits_per_s: float = 400e9
    link_latency_s: float = 100e-6

    @classmethod
    def of(cls, model: ModelProfile, hardware: HardwareProfile, link_bits_per_s: float,
           link_latency_s: float) -> LoadCost:
        return cls(model.kv_bytes_per_token, model.tensor_parallel, hardware.pcie_bandwidth,
                   link_bits_per_s, link_latency_s)

    def host_seconds_per_token(self) -> float:
        return self.kv_bytes_per_token / max(self.tensor_parallel, 1) / self.pcie_bytes_per_s

    def pool_seconds_per_token(self) -> float:
        return self.kv_bytes_per_token * 8 / self.link_bits_per_s

    def seconds(self, host_tokens: int, pool_tokens: int) -> float:
        t = host_tokens * self.host_seconds_per_token()
        if pool_tokens > 0:
            t += self.link_latency_s + pool_tokens * self.pool_seconds_per_token()
        return t


@dataclass(slots=True)
class TierHit:
    """Where a prompt's leading blocks are: ``gpu`` blocks on GPU, then ``host`` in host
    memory, then ``pool`` in the shared pool (counts of blocks, in prompt order)."""

    gpu: int
    host: int = 0
    pool: int = 0
    fetched: int = 0  # pool blocks the pool really returned (set by the load)

    @property
    def blocks(self) -> int:
        return self.host + self.pool


class HostTier:
    """Block hashes held in the instance's host memory: an LRU of ``capacity`` blocks.

    ``store`` takes the GPU pool's ``BlockStored`` events (what was just computed) and
    returns the host tier's own events, in vLLM's vocabulary with ``medium`` CPU."""

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError("a host KV tier needs room for at least one block")
        self.capacity = capacity
        self.stats = TierStats()
        self._lru: OrderedDict[BlockHash, None] = OrderedDict()

    def __contains__(self, h: object) -> bool:
        return h in self._lru

    def __len__(self) -> int:
        return len(self._lru)

    def store(self, events: Iterable[KVEvent]) -> list[KVEvent]:
        out: list[KVEvent] = []
        for e in events:
            if e.kind != "BlockStored" or e.medium != "GPU":
                continue  # a GPU cache reset (AllBlocksCleared) leaves host memory as it is
            new = []
            for h in e.block_hashes:
                if h in self._lru:
                    self._lru.move_to_end(BlockHash(h))
                else:
                    self._lru[BlockHash(h)] = None
                    new.append(h)
            if new:
                self.stats.stored_blocks += len(new)
                out.append(KVEvent("BlockStored", tuple(new), e.parent_block_hash,
                                   e.token_ids, e.salt, CPU))
            out.extend(self._evict())
        return out

    def touch(self, hashes: Sequence[BlockHash]) -> None:
        """The blocks were just used (a hit): they are the most recent."""
        for h in hashes:
            if h in self._lru:
                self._lru.move_to_end(h)

    def _evict(self) -> list[KVEvent]:
        gone = []
        while len(self._lru) > self.capacity:
            h, _ = self._lru.popitem(last=False)
            gone.append(h)
        if not gone:
            return []
        self.stats.evicted_blocks += len(gone)
        return [KVEvent("BlockRemoved", tuple(gone), medium=CPU)]


@dataclass(slots=True)
class TierWalk:
    """The lookup order GPU → host → pool for one request's prompt."""

    host: HostTier | None = None
    queried_blocks: int = 0  # blocks looked up past the GPU hit (vLLM's external queries)

    def plan(self, hashes: Sequence[BlockHash], gpu_blocks: int, max_blocks: int,
             pool_prefix: int) -> TierHit | None:
        """Blocks to load after ``gpu_blocks`` GPU hits; ``pool_prefix``: leading blocks the
        pool said it holds when the request arrived. None when no lower tier helps."""
        i = gpu_blocks
        end = min(max_blocks, len(hashes))
        self.queried_blocks += max(0, end - i)
        host = self.host
        if host is not None:
            while i < end and hashes[i] in host:
                i += 1
        n_host = i - gpu_blocks
        n_pool = max(0, min(pool_prefix, end) - i)
        if n_host == 0 and n_pool == 0:
            return None
        if host is not None and n_host:
            host.touch(hashes[gpu_blocks:i])
        return TierHit(gpu_blocks, n_host, n_pool)


def computed_blocks(events: Iterable[KVEvent], block_size: int
                    ) -> Iterator[tuple[int, int | None, tuple[int, ...], str | None]]:
    """(hash, parent, token ids, salt) of every block the GPU cache's events say it just
    registered, in order: what goes to the pool."""
    for e in events:
        if e.kind == "BlockStored" and e.medium == "GPU":
            parent = e.parent_block_hash
            for i, h in enumerate(e.block_hashes):
                yield (h, parent, e.token_ids[i * block_size:(i + 1) * block_size],
                       e.salt if i == 0 else None)
                parent = h
