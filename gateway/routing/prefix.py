"""Prefix-cache affinity: the prompt's KV block hashes, and which endpoint probably holds them.

*Hashing.* A prompt's full blocks are hashed with the reference backend's chained scheme
(``protocol.kv_hash``: block ``i`` names the whole prefix up to its end, the first block carries
the cache salt, the root separates models), so in precise mode the gateway's hashes are the
very hashes the backend reports in its KV events. Chat prompts are hashed incrementally: the
hash state after a request's messages is cached under a key chained from the messages' keys,
so the next turn of the same conversation hashes only its new pieces (the pieces' token ids come
from ``gateway.counting.tokenize``'s cache). Computed once per request.

*Approximate index* (``gateway.routing.approx_index``): per endpoint, the block hashes it was
sent, sized from the endpoint's KV capacity (``num_gpu_blocks`` scraped from
``vllm:cache_config_info``), updated only when a decision is acted on and forgetting the
least recently sent first, as the engine's LRU would.

*Precise index* (``PreciseIndex``): per endpoint, exactly the hashes the backend's
KV events say it holds (``gateway.routing.kv_events`` follows them over ZMQ).

Both answer ``matched(hashes)``: how many leading blocks the endpoint holds. Caches hold whole
prefixes (a block is stored only after its parent, the engine frees tail blocks first), so the
longest cached prefix is found by binary search.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from gateway.counting.tokenize import ChatPrompt
from protocol.kv_hash import BlockHash, chain_hash_array, hash_block, root_hash


def extend_hashes(hashes: array[int], tail: array[int], tokens: Iterable[int], block_size: int,
                  root: int, salt: bytes) -> None:
    """Feed ``tokens`` into (hashes, tail): every block that fills up is hashed and appended."""
    tail.extend(tokens)
    full = len(tail) // block_size
    if not full:
        return
    have = len(hashes)
    hashes.extend(chain_hash_array(hashes[-1] if have else root,
                                   tail[:full * block_size].tobytes(), block_size * 4,
                                   b"" if have else salt))
    del tail[:full * block_size]


def hash_all(tokens: Sequence[int], block_size: int, root: int, salt: str | None = None
             ) -> array[int]:
    """The chained hashes of every full block of ``tokens``, as an ``array("Q")``."""
    hashes: array[int] = array("Q")
    extend_hashes(hashes, array("I"), tokens, block_size, root, (salt or "").encode())
    return hashes


def block_hashes(tokens: Sequence[int], block_size: int, root: int,
                 salt: str | None = None) -> list[BlockHash]:
    """The chained hashes of every full block of ``tokens`` (no caching)."""
    return [BlockHash(h) for h in hash_all(tokens, block_size, root, salt)]


@dataclass(slots=True)
class HashJob:
    """What is left to hash of a chat prompt (``PromptHasher.resume``)."""

    pieces: Sequence[array[int]]
    stable: int  # how many of ``pieces`` are stable (their state is remembered)
    hashes: array[int]
    tail: array[int]
    block_size: int
    root: int
    salt: bytes
    remember: int | None  # the key the stable state is cached under, if it is new
    before: int = field(init=False)

    def __post_init__(self) -> None:
        self.before = len(self.hashes)

    @property
    def tokens(self) -> int:
        return sum(len(ids) for ids in self.pieces)

    def run(self) -> tuple[array[int], array[int]] | None:
        """Hash the pieces; answers the state after the stable ones (to cache), if new."""
        stable = None
        for i, ids in enumerate(self.pieces):
            if i == self.stable and self.remember is not None:
                stable = (array("Q", self.hashes), array("I", self.tail))
            extend_hashes(self.hashes, self.tail, ids, self.block_size, self.root, self.salt)
        if self.stable == len(self.pieces) and self.remember is not None:
            stable = (array("Q", self.hashes), array("I", self.tail))
        return stable


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

    def chat(self, prompt: ChatPrompt, salt: str | None = None) -> tuple[Sequence[int], int]:
        """(block hashes, prompt tokens) of a rendered chat prompt. The hash state after the
        prompt's stable pieces is cached under a key chained from the pieces' keys, so the next
        turn of the conversation hashes only what it added."""
        job = self.resume(prompt, salt)
        return self.finish(job, job.run()), prompt.tokens

    def resume(self, prompt: ChatPrompt, salt: str | None = None) -> HashJob:
        """The hashing ``prompt`` still needs, from the longest cached state of its stable
        pieces (``HashJob.run`` is pure: it may run in a worker thread; ``finish`` then
        caches its state, on the caller's thread)."""
        chain = [hash((self.root, salt))]
        for k in prompt.keys[:prompt.stable]:
            chain.append(hash((chain[-1], k)))
        start = 0
        hashes: array[int] = array("Q")
        tail: array[int] = array("I")
        for k in range(prompt.stable, 0, -1):
            st = self._states.get(chain[k])
            if st is not None:
                self._states.move_to_end(chain[k])
                hashes, tail = array("Q", st[0]), array("I", st[1])
                start = k
                break
        return HashJob(prompt.ids[start:], prompt.stable - start, hashes, tail,
                       self.block_size, self.root, (salt or "").encode(),
                       chain[prompt.stable] if start < prompt.stable else None)

    def finish(self, job: HashJob, stable: tuple[array[int], array[int]] | None
               ) -> array[int]:
        if job.remember is not None and stable is not None:
            self._remember(job.remember, *stable)
        self.blocks_hashed += len(job.hashes) - job.before
        return job.hashes

    def tokens(self, ids: Sequence[int], salt: str | None = None) -> array[int]:
        hashes = hash_all(ids, self.block_size, self.root, salt)
        self.blocks_hashed += len(hashes)
        return hashes

    def _remember(self, key: int, hashes: array[int], tail: array[int]) -> None:
        self._states[key] = (array("Q", hashes), array("I", tail))
        self._held += len(hashes) + 1
        while self._held > self._cap and len(self._states) > 1:
            _, (h, _) = self._states.popitem(last=False)
            self._held -= len(h) + 1


class Index(Protocol):
    def matched(self, endpoint: str, hashes: Sequence[int]) -> int: ...
    def record(self, endpoint: str, hashes: Sequence[int], matched: int = 0) -> None: ...


def longest_held(held: Mapping[int, Any] | set[int], hashes: Sequence[int]) -> int:
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


def continued(held: Mapping[int, Any] | set[int] | None, hashes: Sequence[int], start: int,
              end: int) -> int:
    """The first index from ``start`` (below ``end``) whose block ``held`` lacks."""
    i = start
    if held:
        while i < end and hashes[i] in held:
            i += 1
    return i


class _EngineBlocks:
    """One engine's cache in the gateway's own hashes: its block hash → ours, and what each
    medium (GPU, CPU offload…) holds."""

    __slots__ = ("held", "ours")

    def __init__(self) -> None:
        self.ours: dict[Any, int] = {}
        self.held: dict[str, set[int]] = {}


GPU = "GPU"


class PreciseIndex:
    """Exactly the blocks each endpoint's engine reports through its KV events
    (``gateway.routing.kv_events``).

    The engine's block hashes are its own (vLLM hashes with its own function and seeds), so
    they are related to the gateway's by the events' token ids: a stored block's hash here is
    ``hash_block(our hash of its parent, its tokens, the cache salt of a first block)``, the
    same chained hash ``PromptHasher`` gives the prompt that filled it. No engine-internal hash
    function is copied. Blocks of LoRA adapters or with multimodal extra keys are not indexed
    (prompts are hashed for the base model, text only). ``matched`` counts GPU blocks;
    other media are kept per medium (``size``).

    ``same_hashes``: the engines hash blocks exactly as this gateway does (the simulator's
    backends, which take the gateway's hashes), so a stored block's hash is taken as it is."""

    def __init__(self, *, same_hashes: bool = False) -> None:
        self.same_hashes = same_hashes
        self._engines: dict[str, _EngineBlocks] = {}
        self._roots: dict[str, int] = {}
        self.unmapped = 0  # stored blocks whose parent this index never saw

    def set_root(self, endpoint: str, root: int) -> None:
        if self._roots.get(endpoint) != root:
            self._roots[endpoint] = root
            self._engines.pop(endpoint, None)

    def matched(self, endpoint: str, hashes: Sequence[int]) -> int:
        e = self._engines.get(endpoint)
        held = e.held.get(GPU) if e is not None else None
        return longest_held(held, hashes) if held else 0

    def walk(self, endpoint: str, medium: str, hashes: Sequence[int], start: int, end: int
             ) -> int:
        """Past ``start``, how far ``hashes`` continue in ``medium`` there (a lower tier's
        LRU need not hold whole prefixes, so this walks rather than bisects)."""
        e = self._engines.get(endpoint)
        return continued(e.held.get(medium) if e is not None else None, hashes, start, end)

    def record(self, endpoint: str, hashes: Sequence[int], matched: int = 0) -> None:
        """Decisions do not change the precise view: the engine's events will."""

    def clear(self, endpoint: str) -> None:
        self._engines.pop(endpoint, None)

    def apply(self, endpoint: str, events: Iterable[Any]) -> None:
        """Apply decoded engine events (``kv_events.EngineEvent``)."""
        e = self._engines.get(endpoint)
        if e is None:
            e = self._engines[endpoint] = _EngineBlocks()
        root = self._roots.get(endpoint, 0)
        for ev in events:
            kind = ev.type
            medium = ev.medium or GPU
            if kind == "BlockStored":
                self._stored(e, ev, root, medium)
            elif kind == "BlockRemoved":
                held = e.held.get(medium)
                for h in ev.block_hashes:
                    ours = e.ours.get(h)
                    if ours is None:
                        continue
                    if held is not None:
                        held.discard(ours)
                    if not any(ours in s for s in e.held.values()):
                        del e.ours[h]
            elif kind == "AllBlocksCleared":
                # the medium's cache was reset (a GPU reset leaves host memory as it is)
                e.held.pop(medium, None)
                if not e.held:
                    e.ours.clear()

    def _stored(self, e: _EngineBlocks, ev: Any, root: int, medium: str) -> None:
        if ev.lora_name is not None or ev.lora_id is not None:
            return
        if self.same_hashes:
            held = e.held.setdefault(medium, set())
            for h in ev.block_hashes:
                e.ours[h] = h
                held.add(h)
            return
        bs = ev.block_size
        n = len(ev.block_hashes)
        if bs <= 0 or len(ev.token_ids) < n * bs:
            return
        if ev.parent_block_hash is None:
            parent: int | None = root
        else:
            parent = e.ours.get(ev.parent_block_hash)
        held = e.held.setdefault(medium, set())
        extra = ev.extra_keys or [None] * n
        for i, h in enumerate(ev.block_hashes):
            if parent is None:
                self.unmapped += n - i
                return
            salt = b""
            keys = extra[i] if i < len(extra) else None
            if keys:
                first = parent == root and i == 0 and ev.parent_block_hash is None
                if not (first and len(keys) == 1 and isinstance(keys[0], str)):
                    return  # multimodal or other extra keys: not a text prefix we hash
                salt = keys[0].encode()
            ours = hash_block(parent, ev.token_ids[i * bs:(i + 1) * bs], salt)
            e.ours[h] = ours
            held.add(ours)
            parent = ours

    def size(self, endpoint: str, medium: str = GPU) -> int:
        e = self._engines.get(endpoint)
        return len(e.held.get(medium, ())) if e is not None else 0
