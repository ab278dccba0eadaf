"""The block pool: reference counts, LRU free queue, prefix-cache registration and events."""

from __future__ import annotations

import pytest

from backend.block_pool import BlockPool, OutOfBlocks
from protocol.kv_hash import BlockHash


def h(n: int) -> BlockHash:
    return BlockHash(n)


def test_allocate_takes_from_head_and_free_appends_to_tail() -> None:
    pool = BlockPool(5)
    a = pool.allocate(3)
    assert [b.block_id for b in a] == [0, 1, 2]
    assert pool.free_order() == [3, 4]
    pool.free(reversed(a))
    # A request's tail is freed first, so it is evicted first.
    assert pool.free_order() == [3, 4, 2, 1, 0]
    assert pool.num_free == 5 and all(b.ref_cnt == 0 for b in pool.blocks)


def test_eviction_follows_lru_order_and_emits_removed_events() -> None:
    pool = BlockPool(4)
    blocks = pool.allocate(3)
    for i, b in enumerate(blocks):
        pool.cache(b, h(100 + i), h(99 + i) if i else None, [i] * 4)
    pool.free(reversed(blocks))
    pool.drain_events()
    taken = pool.allocate(2)  # block 3 (never cached), then block 2 (the tail)
    assert [b.block_id for b in taken] == [3, 2]
    assert pool.lookup(h(102)) is None
    assert pool.lookup(h(100)) is blocks[0] and pool.lookup(h(101)) is blocks[1]
    events = pool.drain_events()
    assert [(e.kind, e.block_hashes) for e in events] == [("BlockRemoved", (102,))]


def test_touch_revives_a_cached_free_block() -> None:
    pool = BlockPool(3)
    (b,) = pool.allocate(1)
    pool.cache(b, h(7), None, [1, 2])
    pool.free([b])
    assert pool.num_free == 3
    pool.touch([b])
    assert b.ref_cnt == 1 and pool.num_free == 2 and b.block_id not in pool.free_order()
    pool.touch([b])
    assert b.ref_cnt == 2
    pool.free([b, b])
    assert pool.free_order()[-1] == b.block_id


def test_cache_registers_once_and_reports_stored_event() -> None:
    pool = BlockPool(2)
    b1, b2 = pool.allocate(2)
    pool.cache(b1, h(5), h(4), [9, 9])
    pool.cache(b2, h(5), h(4), [9, 9])  # same prefix in another block: stays anonymous
    assert pool.lookup(h(5)) is b1 and b2.block_hash is None
    (e,) = pool.drain_events()
    assert (e.kind, e.block_hashes, e.parent_block_hash, e.token_ids) == (
        "BlockStored", (5,), 4, (9, 9))


def test_over_allocation_and_double_free_are_errors() -> None:
    pool = BlockPool(2)
    with pytest.raises(OutOfBlocks):
        pool.allocate(3)
    (b,) = pool.allocate(1)
    pool.free([b])
    with pytest.raises(AssertionError):
        pool.free([b])


def test_reset_cache_only_when_idle() -> None:
    pool = BlockPool(2)
    (b,) = pool.allocate(1)
    pool.cache(b, h(1), None, [1])
    assert not pool.reset_cache()
    pool.free([b])
    assert pool.reset_cache() and pool.num_cached == 0
    assert pool.drain_events()[-1].kind == "AllBlocksCleared"
