"""The shared KV pool's store: blocks by hash, an LRU bounded in bytes (Mooncake Store's
role). The reference backend moves no tensors, so a block here is its identity (hash,
parent, tokens: what a KV event carries) and its size; what a transfer costs is modelled by
the instance that fetches it.

Instances ``put`` what they computed; ``lookup`` says how many leading blocks of a prompt the
pool holds (a prefix stops at its first hole); ``fetch`` takes those blocks (refreshing them
in the LRU) and says how many bytes moved. When a put goes over the capacity the least
recently used blocks are evicted, and every change is a KV event with ``medium`` POOL.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from backend.block_pool import KVEvent
from backend.kv_tiers import POOL


@dataclass(frozen=True, slots=True)
class PoolBlock:
    parent: int | None
    token_ids: tuple[int, ...]
    salt: str | None
    nbytes: int
    block_size: int


@dataclass(slots=True)
class PoolStats:
    puts: int = 0  # blocks stored (new ones)
    lookups: int = 0
    lookup_blocks: int = 0  # blocks asked about
    lookup_hits: int = 0  # leading blocks found
    fetches: int = 0
    fetched_blocks: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    evictions: int = 0


class PoolStore:
    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes <= 0:
            raise ValueError("the KV pool needs a positive capacity")
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self.stats = PoolStats()
        self.events: list[KVEvent] = []
        self._blocks: OrderedDict[int, PoolBlock] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, h: object) -> bool:
        return h in self._blocks

    def put(self, h: int, block: PoolBlock) -> bool:
        """Store one block (refresh it when held); False when it can never fit."""
        if block.nbytes > self.capacity_bytes:
            return False
        if h in self._blocks:
            self._blocks.move_to_end(h)
            return True
        self._blocks[h] = block
        self.used_bytes += block.nbytes
        self.stats.puts += 1
        self.stats.bytes_in += block.nbytes
        self.events.append(KVEvent("BlockStored", (h,), block.parent, block.token_ids,
                                   block.salt, POOL, block.block_size))
        self._evict()
        return True

    def lookup(self, hashes: Sequence[int]) -> int:
        n = 0
        for h in hashes:
            if h not in self._blocks:
                break
            n += 1
        self.stats.lookups += 1
        self.stats.lookup_blocks += len(hashes)
        self.stats.lookup_hits += n
        return n

    def fetch(self, hashes: Sequence[int]) -> tuple[int, int]:
        """(leading blocks held, their bytes); they become the most recently used."""
        n = nbytes = 0
        for h in hashes:
            b = self._blocks.get(h)
            if b is None:
                break
            self._blocks.move_to_end(h)
            n += 1
            nbytes += b.nbytes
        self.stats.fetches += 1
        self.stats.fetched_blocks += n
        self.stats.bytes_out += nbytes
        return n, nbytes

    def drain_events(self) -> list[KVEvent]:
        out, self.events = self.events, []
        return out

    def _evict(self) -> None:
        gone = []
        while self.used_bytes > self.capacity_bytes and self._blocks:
            h, b = self._blocks.popitem(last=False)
            self.used_bytes -= b.nbytes
            gone.append(h)
        if gone:
            self.stats.evictions += len(gone)
            self.events.append(KVEvent("BlockRemoved", tuple(gone), medium=POOL))
