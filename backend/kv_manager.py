"""Per-request block tables on top of the block pool (vLLM v1's KVCacheManager).

* ``computed_blocks`` finds the longest cached prefix of a request: full blocks only, and at
  most ``num_tokens - 1`` tokens, because the last token must be computed to sample from it.
* ``allocate_slots`` makes room for the tokens a step will compute (taking references on the
  prefix-hit blocks first) and registers the blocks those tokens fill in the prefix cache.
* ``free`` releases a request's blocks, tail first, so its tail is evicted before its head.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from backend.block_pool import BlockPool, KVBlock
from backend.request import Request
from protocol.kv_hash import BlockHash, extend_block_hashes


@dataclass(slots=True)
class PrefixStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # tokens found cached


@dataclass(slots=True)
class KVCacheManager:
    pool: BlockPool
    block_size: int
    root: BlockHash
    stats: PrefixStats = field(default_factory=PrefixStats)
    _tables: dict[str, list[KVBlock]] = field(default_factory=dict)
    _num_cached: dict[str, int] = field(default_factory=dict)

    def blocks_of(self, request_id: str) -> list[KVBlock]:
        return self._tables.get(request_id, [])

    def update_hashes(self, req: Request) -> None:
        extend_block_hashes(req.block_hashes, req.token_ids, self.block_size, self.root,
                            req.cache_salt)

    def computed_blocks(self, req: Request) -> tuple[list[KVBlock], int]:
        """Longest cached prefix of ``req`` as (blocks, tokens); no references are taken."""
        if not self.pool.enable_caching:
            return [], 0
        self.update_hashes(req)
        max_blocks = (req.num_tokens - 1) // self.block_size
        hit: list[KVBlock] = []
        for h in req.block_hashes[:max_blocks]:
            block = self.pool.lookup(h)
            if block is None:
                break
            hit.append(block)
        return hit, len(hit) * self.block_size

    def record_lookup(self, req: Request, hit_tokens: int) -> None:
        self.stats.queries += req.num_tokens
        self.stats.hits += hit_tokens

    def can_allocate(self, req: Request, num_new_tokens: int,
                     computed: list[KVBlock] | None = None) -> bool:
        return self._blocks_needed(req, num_new_tokens, computed or []) >= 0

    def _blocks_needed(self, req: Request, num_new_tokens: int, computed: list[KVBlock]) -> int:
        """Free blocks left after this allocation would succeed (negative: it cannot)."""
        table = self._tables.get(req.request_id, [])
        total = req.num_computed_tokens + len(computed) * self.block_size + num_new_tokens
        required = -(-total // self.block_size)
        new_blocks = max(0, required - len(table) - len(computed))
        evictable_hits = sum(1 for b in computed if b.ref_cnt == 0)
        return self.pool.num_free - evictable_hits - new_blocks

    def allocate_slots(
        self,
        req: Request,
        num_new_tokens: int,
        computed: list[KVBlock] | None = None,
    ) -> bool:
        """Reserve blocks so ``num_new_tokens`` more tokens fit after the computed prefix.

        ``computed`` are prefix-hit blocks from ``computed_blocks`` (first scheduling only).
        Returns False, changing nothing, when there are not enough free blocks.
        """
        if not computed:
            held = self._tables.get(req.request_id)
            if held is not None and (req.num_computed_tokens + num_new_tokens
                                     <= len(held) * self.block_size):
                return True  # the blocks it holds have room (most decode steps)
        computed = computed or []
        if self._blocks_needed(req, num_new_tokens, computed) < 0:
            return False
        table = self._tables.setdefault(req.request_id, [])
        self.pool.touch(computed)
        table.extend(computed)
        total = req.num_computed_tokens + len(computed) * self.block_size + num_new_tokens
        required = -(-total // self.block_size)
        if required > len(table):
            table.extend(self.pool.allocate(required - len(table)))
        return True

    def cache_computed(self, req: Request, num_tokens: int) -> None:
        """Register the full blocks among the first ``num_tokens`` tokens in the prefix cache."""
        table = self._tables.get(req.request_id)
        if table is None:
            return
        start = self._num_cached.get(req.request_id, 0)
        if num_tokens // self.block_size <= start:
            return  # no block filled up since the last call
        self.update_hashes(req)
        end = min(num_tokens // self.block_size, len(table), len(req.block_hashes))
        bs = self.block_size
        for i in range(start, end):
            parent = req.block_hashes[i - 1] if i else None
            self.pool.cache(table[i], req.block_hashes[i], parent,
                            req.token_ids[i * bs:(i + 1) * bs],
                            req.cache_salt if i == 0 else None)
        if end > start:
            self._num_cached[req.request_id] = end

    def take(self, request_id: str) -> list[KVBlock]:
        """Detach a request's block table without freeing it (the blocks stay referenced)."""
        self._num_cached.pop(request_id, None)
        return self._tables.pop(request_id, [])

    def free(self, request_id: str) -> None:
        """Release every block of the request, tail first."""
        self.pool.free(reversed(self.take(request_id)))

    def num_requests(self) -> int:
        return len(self._tables)
