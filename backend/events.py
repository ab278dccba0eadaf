"""The KV event stream: which prefix blocks this instance stores and evicts, in order.

Every batch of block-pool events gets a sequence number and is kept in a bounded ring, so a
router can follow the cache exactly (``GET /kv/events`` as server-sent events, resuming with
``?since=SEQ`` or ``Last-Event-ID``). A subscriber that fell out of the ring is told to resync
(``event: reset``) and can fetch the full set of cached hashes from ``GET /kv/blocks``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from backend.block_pool import KVEvent


@dataclass(frozen=True, slots=True)
class EventBatch:
    seq: int
    ts: float
    events: tuple[KVEvent, ...]

    def to_json(self, block_size: int) -> dict[str, Any]:
        out: list[dict[str, Any]] = []
        for e in self.events:
            item: dict[str, Any] = {"type": e.kind, "block_hashes": list(e.block_hashes)}
            if e.kind == "BlockStored":
                item["parent_block_hash"] = e.parent_block_hash
                item["token_ids"] = list(e.token_ids)
                item["block_size"] = block_size
            out.append(item)
        return {"seq": self.seq, "ts": self.ts, "events": out}


class KVEventLog:
    def __init__(self, capacity: int = 4096) -> None:
        self._ring: deque[EventBatch] = deque(maxlen=capacity)
        self._seq = 0
        self._changed = asyncio.Event()

    @property
    def last_seq(self) -> int:
        return self._seq

    def publish(self, events: Iterable[KVEvent]) -> None:
        batch = tuple(events)
        if not batch:
            return
        self._seq += 1
        self._ring.append(EventBatch(self._seq, time.time(), batch))
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    def since(self, seq: int) -> tuple[list[EventBatch], bool]:
        """Batches after ``seq``, and whether the caller missed some (must resync)."""
        if not self._ring:
            return [], seq < self._seq
        first = self._ring[0].seq
        missed = seq < first - 1
        return [b for b in self._ring if b.seq > seq], missed

    async def wait(self, seq: int, max_wait_s: float) -> None:
        """Wait until a batch newer than ``seq`` exists (or ``max_wait_s`` passes)."""
        if self._seq > seq:
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._changed.wait(), max_wait_s)
