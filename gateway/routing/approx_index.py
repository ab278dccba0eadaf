"""The approximate prefix index: what each endpoint probably caches, learnt from the gateway's
own decisions (``gateway.routing.prefix`` has the hashing and the precise index)."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Sequence
from itertools import islice, repeat

from gateway.routing.prefix import longest_held


class ApproxIndex:
    """What each endpoint probably caches, from the gateway's own decisions.

    Per endpoint, block hash → the decision that last sent it there (a tick), kept in the
    order they were sent (a block sent again is moved to the end): the dict's order is the
    LRU order. Recording a prompt is C-level work however long the prompt (a 100K-token agent
    turn touches ~6,000 blocks): the blocks are popped and re-inserted with ``map`` and
    ``dict.update``; when an endpoint holds 25% more blocks than its KV capacity, the oldest
    are dropped from the front down to the capacity, again without a Python loop per block
    (no sort). On a slow core that is still ~0.15 µs a block, ~7 ms for a 3 MB prompt's 47K
    blocks: with ``chunk`` set (``serve`` sets it; the simulator keeps every record whole),
    a prompt with more blocks is recorded ``chunk`` blocks per event-loop step, its head at
    once (the next request matches it immediately), the rest tail first in later steps and
    the head moved last again, so the event loop is never held for more than one chunk.
    """

    SLACK = 1.25

    def __init__(self, default_capacity: int = 100_000) -> None:
        # Called with (endpoint, blocks refreshed) on every local record: shares them.
        self.on_record: Callable[[str, Sequence[int]], None] | None = None
        self._seen: dict[str, dict[int, int]] = {}
        self._cap: dict[str, int] = {}
        self._tick = 0
        self.default_capacity = default_capacity
        self.chunk: int | None = None  # blocks recorded per event-loop step (None: all at once)
        self._work: deque[tuple[dict[int, int], str, Sequence[int], int]] = deque()

    def set_capacity(self, endpoint: str, blocks: int) -> None:
        self._cap[endpoint] = max(int(blocks), 1)
        seen = self._seen.get(endpoint)
        if seen is not None and len(seen) > self._cap[endpoint]:
            self._evict(seen, self._cap[endpoint])

    def matched(self, endpoint: str, hashes: Sequence[int]) -> int:
        seen = self._seen.get(endpoint)
        return longest_held(seen, hashes) if seen else 0

    REFRESH_EVERY = 64  # decisions: how stale a cached prefix's recency may get

    def record(self, endpoint: str, hashes: Sequence[int], matched: int = 0) -> None:
        """The request was sent there: its blocks are now the endpoint's most recent.
        ``matched`` leading blocks were already there; they are refreshed only when their
        recency is older than ``REFRESH_EVERY`` decisions, so a long agent conversation
        pays for its new blocks, not for its whole history, on every turn."""
        if not hashes:
            return
        # no more than the endpoint holds: a prefix match starts at the first block, so the
        # blocks of a prompt longer than the cache could only push out its own beginning
        hashes = hashes[:self._cap.get(endpoint, self.default_capacity)]
        matched = min(matched, len(hashes))
        seen = self._seen.setdefault(endpoint, {})
        self._tick += 1
        start = 0
        if matched and seen.get(hashes[matched - 1], 0) > self._tick - self.REFRESH_EVERY:
            start = matched
        fresh = hashes[start:]
        self._store_soon(seen, endpoint, fresh)
        if self.on_record is not None:
            self.on_record(endpoint, fresh)

    def record_remote(self, endpoint: str, hashes: Sequence[int]) -> None:
        """Another gateway replica sent these blocks to ``endpoint`` (``routing.prefix_hints``)."""
        if hashes:
            self._tick += 1
            self._store_soon(self._seen.setdefault(endpoint, {}), endpoint, hashes)

    def _store_soon(self, seen: dict[int, int], endpoint: str, fresh: Sequence[int]) -> None:
        n = self.chunk
        if n is None or len(fresh) <= n:
            self._store(seen, endpoint, fresh, self._tick)
            return
        head = fresh[:n]
        self._store(seen, endpoint, head, self._tick)
        # tail first, the head last again: once done, the order is as if stored at once
        pieces = [fresh[i:i + n] for i in range(n, len(fresh), n)]
        pieces.reverse()
        pieces.append(head)
        self._work.extend((seen, endpoint, p, self._tick) for p in pieces)
        if len(self._work) == len(pieces):
            asyncio.get_running_loop().call_soon(self._step)

    def _step(self) -> None:
        """One piece of the recording still to do (one per event-loop step, whatever the
        number of prompts recording)."""
        if self._work:
            self._store(*self._work.popleft())
        if self._work:
            asyncio.get_running_loop().call_soon(self._step)

    def _store(self, seen: dict[int, int], endpoint: str, fresh: Sequence[int], tick: int
               ) -> None:
        # Sent again: to the end (the most recent). Tail first: among blocks sent by the same
        # decision, the tail is dropped first.
        if seen:
            deque(map(seen.pop, fresh, repeat(None)), maxlen=0)
        seen.update(dict.fromkeys(reversed(fresh), tick))
        cap = self._cap.get(endpoint, self.default_capacity)
        if self.chunk is not None and len(seen) > cap:
            # in steps: evict as it goes, at most twice what a step adds
            self._evict(seen, max(cap, len(seen) - 2 * self.chunk))
        elif len(seen) > cap * self.SLACK:
            self._evict(seen, cap)

    @staticmethod
    def _evict(seen: dict[int, int], cap: int) -> None:
        """Down to ``cap``: the least recently sent (the dict's head) go."""
        deque(map(seen.__delitem__, list(islice(seen, len(seen) - cap))), maxlen=0)

    def forget(self, endpoint: str) -> None:
        self._seen.pop(endpoint, None)

    def held(self, endpoint: str) -> dict[int, int] | None:
        """The endpoint's blocks (hash → tick); read-only for callers."""
        return self._seen.get(endpoint)

    def size(self, endpoint: str) -> int:
        return len(self._seen.get(endpoint, ()))
