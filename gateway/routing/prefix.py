"""Prefix-cache affinity: the prompt's KV block hashes, and which endpoint probably holds them.

*Hashing.* A prompt's full blocks are hashed with the reference backend's chained scheme
(``backend.kv_hash``: block ``i`` names the whole prefix up to its end, the first block carries
the cache salt, the root separates models), so in precise mode the gateway's hashes are the
very hashes the backend reports in its KV events. Chat prompts are hashed incrementally: the
hash state after a request's messages is cached under a key chained from the messages' keys,
so the next turn of the same conversation hashes only its new messages (the per-message token
ids come from ``gateway.tokenize``'s cache). Computed once per request.

*Approximate index* (``ApproxIndex``): per endpoint, an LRU of block hashes sized from the
endpoint's KV capacity (``num_gpu_blocks`` scraped from ``vllm:cache_config_info``), updated
only after a routing decision and forgetting in the order the engine would evict.

*Precise index* (``PreciseIndex``): per endpoint, exactly the hashes the backend's
``/kv/events`` stream says it holds (``gateway.routing.kvevents`` follows it).

Both answer ``matched(hashes)``: how many leading blocks the endpoint holds. Caches hold whole
prefixes (a block is stored only after its parent, the engine frees tail blocks first), so the
longest cached prefix is found by binary search.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol

from backend.kv_hash import BlockHash, hash_block, root_hash
from gateway.tokenize import TokenCounter


def extend_hashes(hashes: array[int], tail: array[int], tokens: Iterable[int], block_size: int,
                  root: int, salt: bytes) -> None:
    """Feed ``tokens`` into (hashes, tail): every block that fills up is hashed and appended."""
    tail.extend(tokens)
    full = len(tail) // block_size
    if not full:
        return
    for i in range(full):
        parent = hashes[-1] if len(hashes) else root
        extra = salt if len(hashes) == 0 else b""
        hashes.append(hash_block(parent, tail[i * block_size:(i + 1) * block_size], extra))
    del tail[:full * block_size]


def block_hashes(tokens: Sequence[int], block_size: int, root: int,
                 salt: str | None = None) -> list[BlockHash]:
    """The chained hashes of every full block of ``tokens`` (no caching)."""
    hashes: array[int] = array("Q")
    extend_hashes(hashes, array("I"), tokens, block_size, root, (salt or "").encode())
    return [BlockHash(h) for h in hashes]


class PromptHasher:
    """Block hashes of prompts for one pool (one block size and hash root)."""

    def __init__(self, namespace: str, block_size: int, *, cache_blocks: int = 2_000_000
                 ) -> None:
        self.namespace = namespace
        self.block_size = block_size
        self.root = root_hash(namespace)
        self._states: OrderedDict[int, tuple[array[int], array[int]]] = OrderedDict()
        self._held = 0
        self._cap = cache_blocks
        self.blocks_hashed = 0

    async def chat(self, counter: TokenCounter, messages: Sequence[Mapping[str, Any]],
                   salt: str | None = None) -> tuple[list[int], int]:
        """(block hashes, prompt tokens as the template renders them) of a chat prompt."""
        chain = [hash((self.root, salt))]
        for m in messages:
            chain.append(hash((chain[-1], *TokenCounter.key(m))))
        start = 0
        hashes: array[int] = array("Q")
        tail: array[int] = array("I")
        for k in range(len(messages), 0, -1):
            st = self._states.get(chain[k])
            if st is not None:
                self._states.move_to_end(chain[k])
                hashes, tail = array("Q", st[0]), array("I", st[1])
                start = k
                break
        salt_b = (salt or "").encode()
        before = len(hashes)
        for m in messages[start:]:
            _, ids = await counter.entry(m)
            extend_hashes(hashes, tail, ids, self.block_size, self.root, salt_b)
        if start < len(messages):
            self._remember(chain[-1], hashes, tail)
        tokens = len(hashes) * self.block_size + len(tail) + len(counter.priming_ids)
        extend_hashes(hashes, tail, counter.priming_ids, self.block_size, self.root, salt_b)
        self.blocks_hashed += len(hashes) - before
        return list(hashes), tokens

    def tokens(self, ids: Sequence[int], salt: str | None = None) -> list[int]:
        hashes = block_hashes(ids, self.block_size, self.root, salt)
        self.blocks_hashed += len(hashes)
        return list(hashes)

    def _remember(self, key: int, hashes: array[int], tail: array[int]) -> None:
        self._states[key] = (array("Q", hashes), array("I", tail))
        self._held += len(hashes) + 1
        while self._held > self._cap and len(self._states) > 1:
            _, (h, _) = self._states.popitem(last=False)
            self._held -= len(h) + 1


class Index(Protocol):
    def matched(self, endpoint: str, hashes: Sequence[int]) -> int: ...
    def record(self, endpoint: str, hashes: Sequence[int]) -> None: ...


def _longest(held: Mapping[int, Any] | set[int], hashes: Sequence[int]) -> int:
    """Leading blocks of ``hashes`` in ``held`` (binary search over the prefix property)."""
    if not hashes or hashes[0] not in held:
        return 0
    if hashes[-1] in held:
        return len(hashes)
    lo, hi = 1, len(hashes) - 1  # hashes[lo-1] held, hashes[hi] not
    while lo < hi:
        mid = (lo + hi) // 2
        if hashes[mid] in held:
            lo = mid + 1
        else:
            hi = mid
    return lo


class ApproxIndex:
    """What each endpoint probably caches, from the gateway's own decisions."""

    def __init__(self, default_capacity: int = 100_000) -> None:
        self._lru: dict[str, OrderedDict[int, None]] = {}
        self._cap: dict[str, int] = {}
        self.default_capacity = default_capacity

    def set_capacity(self, endpoint: str, blocks: int) -> None:
        self._cap[endpoint] = max(int(blocks), 1)
        self._trim(endpoint)

    def matched(self, endpoint: str, hashes: Sequence[int]) -> int:
        lru = self._lru.get(endpoint)
        return _longest(lru, hashes) if lru else 0

    def record(self, endpoint: str, hashes: Sequence[int]) -> None:
        """The request was sent there: its blocks are now the endpoint's most recent."""
        lru = self._lru.setdefault(endpoint, OrderedDict())
        # Touch tail-first so the prompt's first blocks end most recent: an LRU engine evicts a
        # prefix's tail before its head, and so does this index.
        for h in reversed(hashes):
            lru[h] = None
            lru.move_to_end(h)
        self._trim(endpoint)

    def forget(self, endpoint: str) -> None:
        self._lru.pop(endpoint, None)

    def size(self, endpoint: str) -> int:
        return len(self._lru.get(endpoint, ()))

    def _trim(self, endpoint: str) -> None:
        lru = self._lru.get(endpoint)
        if lru is None:
            return
        cap = self._cap.get(endpoint, self.default_capacity)
        while len(lru) > cap:
            lru.popitem(last=False)


class PreciseIndex:
    """Exactly the blocks each endpoint reports through its KV events."""

    def __init__(self) -> None:
        self._held: dict[str, set[int]] = {}

    def matched(self, endpoint: str, hashes: Sequence[int]) -> int:
        held = self._held.get(endpoint)
        return _longest(held, hashes) if held else 0

    def record(self, endpoint: str, hashes: Sequence[int]) -> None:
        """Decisions do not change the precise view: the engine's events will."""

    def reset(self, endpoint: str, hashes: Iterable[int] = ()) -> None:
        self._held[endpoint] = set(hashes)

    def apply(self, endpoint: str, events: Iterable[Mapping[str, Any]]) -> None:
        held = self._held.setdefault(endpoint, set())
        for e in events:
            kind = e.get("type")
            if kind == "BlockStored":
                held.update(e.get("block_hashes", ()))
            elif kind == "BlockRemoved":
                held.difference_update(e.get("block_hashes", ()))
            elif kind == "AllBlocksCleared":
                held.clear()

    def size(self, endpoint: str) -> int:
        return len(self._held.get(endpoint, ()))
