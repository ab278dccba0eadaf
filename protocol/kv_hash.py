"""Chained hashes of full KV-cache blocks (vLLM's prefix-caching scheme).

Block ``i`` of a token sequence is identified by ``H(parent, tokens_i, extra)`` where ``parent``
is block ``i-1``'s hash (the root hash for block 0) and ``extra`` is the request's cache salt on
the first block only. A hash therefore names a whole prefix, not just 16 tokens, so two
sequences share a block hash exactly when they share every token up to the end of that block.
Only full blocks are hashed. The hash is BLAKE2b-64 over a fixed binary layout, so every
process (backend instances, gateway replicas) computes the same value for the same tokens.

A run of blocks is hashed by the compiled ``protocol._kvhash`` when the install built it (it
gives up the GIL for long runs, so a thread hashing a huge prompt does not hold up the event
loop); otherwise by ``hashlib`` here, the same hashes, slower (``NATIVE`` says which).
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from typing import Any, NewType

_native: Any  # the compiled chain_hash_bytes, or None
try:
    from protocol._kvhash import chain_hash_bytes as _native
except ImportError:  # built without a C compiler: the same scheme through hashlib
    _native = None

BlockHash = NewType("BlockHash", int)
NATIVE = _native is not None  # the compiled hashing is in use


def root_hash(namespace: str) -> BlockHash:
    """The parent of block 0: separates caches of different models (or hash schemes)."""
    digest = hashlib.blake2b(b"tokengate-kv-root\x00" + namespace.encode(), digest_size=8)
    return BlockHash(int.from_bytes(digest.digest(), "little"))


def hash_block(parent: int, tokens: Sequence[int], extra: bytes = b"") -> BlockHash:
    """Hash one full block given its parent's hash (``chain_hashes`` of one block)."""
    data = array("I", tokens).tobytes()
    return BlockHash(chain_hashes(parent, data, len(data), extra)[0])


def chain_hash_array(parent: int, data: bytes, block_bytes: int, first_extra: bytes = b""
                     ) -> array[int]:
    """``chain_hashes`` as an ``array("Q")`` (no Python int per block with the compiled
    hashing)."""
    if _native is not None:
        out: array[int] = array("Q")
        out.frombytes(_native(parent, data, block_bytes, first_extra))
        return out
    return array("Q", _chain_hashes_py(parent, data, block_bytes, first_extra))


def chain_hashes(parent: int, data: bytes, block_bytes: int, first_extra: bytes = b""
                 ) -> list[int]:
    """The chained hashes of a run of full blocks (``_chain_hashes_py`` says how)."""
    if _native is not None:
        return chain_hash_array(parent, data, block_bytes, first_extra).tolist()
    return _chain_hashes_py(parent, data, block_bytes, first_extra)


def _chain_hashes_py(parent: int, data: bytes, block_bytes: int, first_extra: bytes = b""
                     ) -> list[int]:
    """The chained hashes of a run of full blocks: ``data`` is their tokens as ``array("I")``
    bytes, ``block_bytes`` one block's bytes, ``first_extra`` the first block's extra (the
    cache salt). Each is BLAKE2b-64 of the parent's 8 bytes, the extra's length (2 bytes) and
    the extra, then the block's tokens, all little-endian: one call per block over one
    concatenation, no per-block array copy."""
    out: list[int] = []
    b2 = hashlib.blake2b
    frombytes = int.from_bytes
    plain = (0).to_bytes(2, "little")
    for start in range(0, len(data) - block_bytes + 1, block_bytes):
        if first_extra and not out:
            head = len(first_extra).to_bytes(2, "little") + first_extra
        else:
            head = plain
        parent = frombytes(b2(parent.to_bytes(8, "little") + head
                              + data[start:start + block_bytes], digest_size=8).digest(),
                           "little")
        out.append(parent)
    return out


def extend_block_hashes(
    hashes: list[BlockHash],
    tokens: Sequence[int],
    block_size: int,
    root: BlockHash,
    salt: str | None = None,
) -> list[BlockHash]:
    """Append the hashes of every newly full block of ``tokens`` to ``hashes`` (in place)."""
    have = len(hashes)
    full = len(tokens) // block_size
    if full <= have:
        return hashes
    data = array("I", tokens[have * block_size:full * block_size]).tobytes()
    extra = salt.encode() if (have == 0 and salt) else b""
    hashes.extend(BlockHash(h) for h in chain_hashes(hashes[-1] if have else root, data,
                                                     block_size * 4, extra))
    return hashes
