"""The approximate prefix index: what each endpoint probably caches, learnt from the gateway's
own decisions (``gateway.routing.prefix`` has the hashing and the precise index)."""

from __future__ import annotations

import asyncio
from bisect import bisect_left
from collections import deque
from collections.abc import Callable, Sequence
from itertools import accumulate, islice, repeat
from operator import and_, or_

from gateway.routing.prefix import longest_held

_BITS = 5  # an entry's value: the tick that recorded it << _BITS | the blocks it stands for
_MASK = (1 << _BITS) - 1


def sampled(hashes: Sequence[int], start: int = 0) -> tuple[list[int], list[int]]:
    """The entries that record ``hashes[start:]``: (their hashes, the blocks each stands for).

    Every block of the first ``DENSE`` is an entry of its own; after them, one block in
    ``STRIDE`` (the last of each run of ``STRIDE``, at positions fixed whatever the prompt's
    length, so a longer turn of the same conversation meets the same ones), standing for its
    run, and the prompt's last block. Block hashes are chained, so an entry held means its
    whole prefix was sent: a prompt is matched to the block in the dense part and to within
    one run after it, or exactly where it ends (an identical prompt, an earlier turn)."""
    n = len(hashes)
    dense, stride = ApproxIndex.DENSE, ApproxIndex.STRIDE
    keys = list(hashes[start:min(dense, n)])
    weights = [1] * len(keys)
    first = max(start, dense)
    first += (stride - 1 - (first - dense) % stride)  # the first run's end at or after it
    if first < n:
        runs = list(hashes[first:n:stride])
        keys += runs
        weights += [stride] * len(runs)
    if n > max(start, dense) and (n - 1 - dense) % stride != stride - 1:
        keys.append(hashes[n - 1])
        weights.append(1)
    return keys, weights


def reach(held: dict[int, int] | None, hashes: Sequence[int], start: int, end: int) -> int:
    """The first block from ``start`` (below ``end``) that ``held``, an index of ``sampled``
    entries, does not hold."""
    if not held or start >= end:
        return start
    dense, stride = ApproxIndex.DENSE, ApproxIndex.STRIDE
    i = start
    if i < dense:
        top = min(end, dense)
        i += longest_held(held, hashes[i:top])
        if i < top or i >= end:
            return i
    # the runs' ends at or after i and below end: k = 0 .. count-1
    first = i + (stride - 1 - (i - dense) % stride)
    count = (end - 1 - first) // stride + 1 if first < end else 0
    lo, hi = 0, count  # runs[:lo] held, runs[hi:] not
    while lo < hi:
        mid = (lo + hi) // 2
        if hashes[first + mid * stride] in held:
            lo = mid + 1
        else:
            hi = mid
    j = first + lo * stride - stride + 1 if lo else i  # all below j are held
    for k in range(min(j + stride - 1, end - 1), j - 1, -1):  # a prompt that ended there
        if hashes[k] in held:
            return k + 1
    return j


class ApproxIndex:
    """What each endpoint probably caches, from the gateway's own decisions.

    Per endpoint, entry hash → the decision that last sent it there (a tick) and the blocks it
    stands for (``sampled``: every block of a prompt's first ``DENSE``, one in ``STRIDE``
    after), kept in the order they were sent (an entry sent again is moved to the end): the
    dict's order is the LRU order. Recording a prompt is C-level work however long the prompt:
    the entries are popped and re-inserted with ``map`` and ``dict.update``; when an endpoint
    holds 25% more blocks than its KV capacity, the oldest entries are dropped from the front
    down to the capacity, again without a Python loop per entry (no sort). A 3 MB prompt's 47K
    blocks are ~4,000 entries; with ``chunk`` set (``serve`` sets it; the simulator keeps every
    record whole), a prompt with more entries is recorded ``chunk`` entries per event-loop
    step, its head at once (the next request matches it immediately), the rest tail first in
    later steps and the head moved last again, so the event loop is never held for more than
    one chunk.
    """

    SLACK = 1.25
    DENSE = 1_024  # blocks recorded one by one at the start of a prompt (16K tokens of 16)
    STRIDE = 16  # after them, one block in this many

    def __init__(self, default_capacity: int = 100_000) -> None:
        # Called with (endpoint, entries, their blocks) on every local record: shares them.
        self.on_record: Callable[[str, Sequence[int], Sequence[int]], None] | None = None
        self._seen: dict[str, dict[int, int]] = {}
        self._blocks: dict[str, int] = {}  # blocks the entries stand for, per endpoint
        self._cap: dict[str, int] = {}
        self._tick = 0
        self.default_capacity = default_capacity
        self.chunk: int | None = None  # entries recorded per event-loop step (None: all at once)
        self._work: deque[tuple[dict[int, int], str, list[int], list[int], int]] = deque()

    def set_capacity(self, endpoint: str, blocks: int) -> None:
        self._cap[endpoint] = max(int(blocks), 1)
        seen = self._seen.get(endpoint)
        if seen is not None and self._blocks[endpoint] > self._cap[endpoint]:
            self._evict(seen, endpoint, self._cap[endpoint])

    def matched(self, endpoint: str, hashes: Sequence[int]) -> int:
        return reach(self._seen.get(endpoint), hashes, 0, len(hashes))

    def walk(self, endpoint: str, hashes: Sequence[int], start: int, end: int) -> int:
        """The first block from ``start`` (below ``end``) the endpoint does not hold."""
        return reach(self._seen.get(endpoint), hashes, start, end)

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
        self._blocks.setdefault(endpoint, 0)
        self._tick += 1
        start = 0
        if matched and seen.get(hashes[matched - 1], 0) >> _BITS > \
                self._tick - self.REFRESH_EVERY:
            start = matched
        keys, weights = sampled(hashes, start)
        self._store_soon(seen, endpoint, keys, weights)
        if self.on_record is not None:
            self.on_record(endpoint, keys, weights)

    def record_remote(self, endpoint: str, keys: Sequence[int], weights: Sequence[int]
                      ) -> None:
        """Another gateway replica recorded these entries for ``endpoint``
        (``routing.prefix_hints``)."""
        if keys and len(keys) == len(weights):
            self._tick += 1
            self._blocks.setdefault(endpoint, 0)
            self._store_soon(self._seen.setdefault(endpoint, {}), endpoint, list(keys),
                             [min(max(int(w), 1), _MASK) for w in weights])

    def _store_soon(self, seen: dict[int, int], endpoint: str, keys: list[int],
                    weights: list[int]) -> None:
        n = self.chunk
        if n is None or len(keys) <= n:
            self._store(seen, endpoint, keys, weights, self._tick)
            return
        self._store(seen, endpoint, keys[:n], weights[:n], self._tick)
        # tail first, the head last again: once done, the order is as if stored at once
        pieces = [(keys[i:i + n], weights[i:i + n]) for i in range(n, len(keys), n)]
        pieces.reverse()
        pieces.append((keys[:n], weights[:n]))
        self._work.extend((seen, endpoint, k, w, self._tick) for k, w in pieces)
        if len(self._work) == len(pieces):
            asyncio.get_running_loop().call_soon(self._step)

    def _step(self) -> None:
        """One piece of the recording still to do (one per event-loop step, whatever the
        number of prompts recording)."""
        if self._work:
            self._store(*self._work.popleft())
        if self._work:
            asyncio.get_running_loop().call_soon(self._step)

    def _store(self, seen: dict[int, int], endpoint: str, keys: list[int], weights: list[int],
               tick: int) -> None:
        if self._seen.get(endpoint) is not seen:
            return  # forgotten meanwhile
        # Sent again: to the end (the most recent). Tail first: among entries sent by the same
        # decision, the tail is dropped first.
        blocks = self._blocks[endpoint]
        if seen:
            blocks -= sum(map(and_, map(seen.pop, keys, repeat(0)), repeat(_MASK)))
        seen.update(zip(reversed(keys), map(or_, repeat(tick << _BITS), reversed(weights)),
                        strict=True))
        blocks += sum(weights)
        self._blocks[endpoint] = blocks
        cap = self._cap.get(endpoint, self.default_capacity)
        if self.chunk is not None and blocks > cap:
            # in steps: evict as it goes, at most twice the entries a step adds
            self._evict(seen, endpoint, cap, 2 * self.chunk)
        elif blocks > cap * self.SLACK:
            self._evict(seen, endpoint, cap)

    def _evict(self, seen: dict[int, int], endpoint: str, cap: int, most: int | None = None
               ) -> None:
        """Down to ``cap`` blocks (or by ``most`` entries): the least recently sent entries
        (the dict's head) go."""
        excess = self._blocks[endpoint] - cap
        if excess <= 0:
            return
        # each entry stands for at least one block: no more than ``excess`` of them go
        upto = list(accumulate(map(and_, islice(seen.values(), min(excess, most or excess)),
                                   repeat(_MASK))))
        if not upto:
            self._blocks[endpoint] = 0
            return
        k = min(bisect_left(upto, excess) + 1, len(upto))
        deque(map(seen.__delitem__, list(islice(seen, k))), maxlen=0)
        self._blocks[endpoint] -= upto[k - 1]

    def forget(self, endpoint: str) -> None:
        self._seen.pop(endpoint, None)
        self._blocks.pop(endpoint, None)

    def held(self, endpoint: str) -> dict[int, int] | None:
        """The endpoint's entries (hash → tick and blocks); read-only for callers."""
        return self._seen.get(endpoint)

    def size(self, endpoint: str) -> int:
        """The blocks the endpoint is thought to hold."""
        return self._blocks.get(endpoint, 0)
