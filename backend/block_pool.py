"""The paged KV cache's block pool: reference counts, a prefix cache, an LRU of free blocks.

As in vLLM v1: every block has a reference count; a block whose count drops to zero goes to
the *tail* of the free queue but keeps its hash, so a later request with the same prefix can
take it back (a prefix-cache hit) until it is reused. New allocations take blocks from the
*head* of the free queue (least recently freed first) and evict the hash they carried. Callers
free a request's blocks in reverse order so that a sequence's tail is evicted before its head,
which is shared more often. Every change to the set of cached hashes is recorded as a
``KVEvent`` (stored / removed) for routers that follow a backend's cache precisely.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from protocol.kv_hash import BlockHash


@dataclass(slots=True, eq=False)
class KVBlock:
    """One block of ``block_size`` token slots in device memory."""

    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None


@dataclass(frozen=True, slots=True)
class KVEvent:
    """A change to the set of cached block hashes, in vLLM's KV-event vocabulary."""

    kind: Literal["BlockStored", "BlockRemoved", "AllBlocksCleared"]
    block_hashes: tuple[int, ...] = ()
    parent_block_hash: int | None = None
    token_ids: tuple[int, ...] = ()
    salt: str | None = None  # the request's cache salt, on a first block (vLLM's extra_keys)
    medium: str = "GPU"  # where the block is: GPU, CPU (host offload), POOL (the shared pool)
    block_size: int = 0  # tokens per block, when the publisher does not know it (the pool)


class OutOfBlocks(RuntimeError):
    """Raised when an allocation asks for more blocks than are free."""


@dataclass(slots=True)
class BlockPool:
    """All KV blocks of one engine. Not thread-safe: owned by the engine loop."""

    num_blocks: int
    enable_caching: bool = True
    record_events: bool = True  # False: nobody follows this cache's events (the simulator)
    # free blocks that may not be handed out: memory another model on the instance holds
    # (``backend.pooling``); ``reserve`` sets it
    reserved: int = 0
    blocks: list[KVBlock] = field(init=False)
    events: list[KVEvent] = field(init=False, default_factory=list)
    # The free queue is the never-used blocks ``_fresh..num_blocks-1`` (created on first use:
    # a pool of many thousand blocks costs nothing until it fills) followed by ``_free``.
    _fresh: int = field(init=False, default=0)
    _free: OrderedDict[int, None] = field(init=False, default_factory=OrderedDict)
    _cached: dict[BlockHash, KVBlock] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        if self.num_blocks <= 0:
            raise ValueError("a KV cache needs at least one block")
        self.blocks = []

    @property
    def num_free(self) -> int:
        """Blocks with no reference (free or cached-but-evictable) that may be allocated."""
        return max(0, self.num_unreferenced - self.reserved)

    @property
    def num_unreferenced(self) -> int:
        """Blocks with no reference, reserved ones included."""
        return self.num_blocks - self._fresh + len(self._free)

    def reserve(self, n: int) -> None:
        """Withhold ``n`` of the free blocks (at most all of them). Growing the reservation
        forgets the prefixes cached in the blocks it covers, least recently freed first: the
        memory they were in now holds another model's data."""
        n = max(0, min(n, self.num_unreferenced))
        if n > self.reserved and self._cached:
            for i, block_id in enumerate(self._free, start=self.num_blocks - self._fresh):
                if i >= n:
                    break
                self._evict(self.blocks[block_id])
        self.reserved = n

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def usage(self) -> float:
        """Fraction of blocks referenced by requests (vLLM's ``kv_cache_usage_perc``)."""
        return 1.0 - self.num_unreferenced / self.num_blocks

    def lookup(self, block_hash: BlockHash) -> KVBlock | None:
        """The block holding this prefix hash, if cached."""
        return self._cached.get(block_hash)

    def free_order(self) -> list[int]:
        """Free block ids from next-to-evict to last-to-evict (for tests and debugging)."""
        return [*range(self._fresh, self.num_blocks), *self._free]

    def allocate(self, n: int) -> list[KVBlock]:
        """Take ``n`` blocks from the head of the free queue, evicting any hash they carried."""
        if n > self.num_free:
            raise OutOfBlocks(f"asked for {n} blocks, {self.num_free} free")
        out: list[KVBlock] = []
        fresh = min(n, self.num_blocks - self._fresh)
        for _ in range(fresh):
            block = KVBlock(self._fresh, 1)
            self.blocks.append(block)
            self._fresh += 1
            out.append(block)
        for _ in range(n - fresh):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on cache-hit blocks, pulling free ones out of the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def free(self, blocks: Iterable[KVBlock]) -> None:
        """Drop a reference on each block; unreferenced blocks join the free queue's tail."""
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt < 0:
                raise AssertionError(f"block {block.block_id} freed twice")
            if block.ref_cnt == 0:
                self._free[block.block_id] = None

    def cache(
        self,
        block: KVBlock,
        block_hash: BlockHash,
        parent: BlockHash | None,
        token_ids: Sequence[int],
        salt: str | None = None,
    ) -> None:
        """Register a full, computed block under its prefix hash."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self._cached:
            return  # another block already holds this prefix; this one stays anonymous
        block.block_hash = block_hash
        self._cached[block_hash] = block
        if self.record_events:
            self.events.append(KVEvent("BlockStored", (block_hash,), parent, tuple(token_ids),
                                       salt))

    def reset_cache(self) -> bool:
        """Forget every cached hash; only allowed when no block is referenced."""
        if self.num_unreferenced != self.num_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self._cached.clear()
        self.events.append(KVEvent("AllBlocksCleared"))
        return True

    def drain_events(self) -> list[KVEvent]:
        out, self.events = self.events, []
        return out

    def _evict(self, block: KVBlock) -> None:
        h = block.block_hash
        if h is None:
            return
        block.block_hash = None
        if self._cached.get(h) is block:
            del self._cached[h]
            if self.record_events:
                self.events.append(KVEvent("BlockRemoved", (h,)))
