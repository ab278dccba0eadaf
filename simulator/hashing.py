"""Block hashes for the simulator: the chained scheme of ``protocol.kv_hash`` (a block's hash
names its whole prefix; the salt goes into the first block), with Python's built-in tuple hash
instead of BLAKE2b. Every part of a simulation (the gateway's prompt hashes, the backends' own
hashing of generated tokens, the precise index) uses this one function, so they agree exactly
as the real parts do; it is ~10x cheaper, which is what lets a 100K-token agent turn or a
15K-token Mooncake prompt cost microseconds here. Tuple hashes of ints are not randomized
(``PYTHONHASHSEED`` salts only str and bytes), so runs are reproducible.
"""

from __future__ import annotations

from collections.abc import Sequence

from backend.kv_manager import KVCacheManager
from backend.request import Request
from protocol.kv_hash import BlockHash


def extend(hashes: list[BlockHash], tokens: Sequence[int], block_size: int, root: int,
           salt: str | None = None) -> list[BlockHash]:
    """Append the hash of every newly full block of ``tokens`` (in place)."""
    for i in range(len(hashes), len(tokens) // block_size):
        parent = hashes[i - 1] if i else root
        hashes.append(BlockHash(hash((parent, salt if i == 0 else None,
                                      tuple(tokens[i * block_size:(i + 1) * block_size])))))
    return hashes


class SimKVCacheManager(KVCacheManager):
    """The backend's KV cache manager, hashing with ``extend``."""

    __slots__ = ()

    def update_hashes(self, req: Request) -> None:
        extend(req.block_hashes, req.token_ids, self.block_size, self.root, req.cache_salt)


class SegmentHasher:
    """Prompts made of fixed segments (Mooncake's 512-token ``hash_ids`` blocks): the hashes
    of a segment's blocks depend only on its parent hash and its id, so they are memoised
    under (parent, id) and a repeated prefix is not hashed again."""

    def __init__(self, block_size: int, root: int, segment: int) -> None:
        if segment % block_size:
            raise ValueError("a segment must be a whole number of blocks")
        self.block_size = block_size
        self.root = root
        self.segment = segment
        self._memo: dict[tuple[int, int], list[BlockHash]] = {}

    def hashes(self, segment_ids: Sequence[int], segments: Sequence[Sequence[int]],
               num_tokens: int) -> list[BlockHash]:
        """Hashes of the first ``num_tokens`` tokens of the concatenated ``segments``."""
        out: list[BlockHash] = []
        full = num_tokens // self.segment
        for sid, toks in zip(segment_ids[:full], segments[:full], strict=True):
            parent = out[-1] if out else self.root
            key = (parent, sid)
            got = self._memo.get(key)
            if got is None:
                got = self._memo[key] = extend([], toks, self.block_size, parent)
            out.extend(got)
        rest = num_tokens - full * self.segment
        if rest >= self.block_size and full < len(segments):
            tail = extend([], segments[full][:rest], self.block_size,
                          out[-1] if out else self.root)
            out.extend(tail)
        return out
