"""Prefix-affinity hints shared across gateway replicas through a Redis stream.

Each replica's approximate index learns only from its own decisions, so behind a load
balancer two replicas would each send a conversation's turns where *they* last sent it, and a
prompt's KV blocks would be computed once per replica. Here every block a replica records as
sent to an endpoint (``ApproxIndex.on_record``: only the newly refreshed part, so a long agent
conversation ships its new blocks, not its history) is batched for ``flush_ms`` and appended to
one stream (``XADD ... MAXLEN ~``); every replica follows the stream (``XREAD BLOCK``) and
records the other replicas' hints as if it had made those decisions. Replicas agree within a
flush interval plus a Redis round trip (~10–20 ms). Hashes are the backend's 64-bit chained
block hashes, shipped packed (8 bytes each).

If Redis is unreachable the replicas keep routing on their own decisions and resume sharing
when it returns (hints made meanwhile are lost: the index is a hint, not a record).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import struct
import uuid
from array import array
from collections.abc import Sequence

from gateway.redis_clients import Executor
from gateway.routing.approx_index import ApproxIndex

log = logging.getLogger("tokengate.routing")
STREAM = "{tokengate:routing}:prefix-hints:2"
_HEAD = struct.Struct("<HI")  # url length, number of entries


def pack(entries: Sequence[tuple[str, bytes, bytes]]) -> bytes:
    """Per record: the head, the URL, the entries' hashes (8 bytes each), then the blocks each
    stands for (a byte each)."""
    out = bytearray()
    for url, hashes, weights in entries:
        u = url.encode()
        out += _HEAD.pack(len(u), len(weights)) + u + hashes + weights
    return bytes(out)


def unpack(data: bytes) -> list[tuple[str, array[int], bytes]]:
    out = []
    pos = 0
    while pos + _HEAD.size <= len(data):
        ulen, n = _HEAD.unpack_from(data, pos)
        pos += _HEAD.size
        url = data[pos:pos + ulen].decode()
        pos += ulen
        hashes = array("Q")
        hashes.frombytes(data[pos:pos + 8 * n])
        pos += 8 * n
        out.append((url, hashes, data[pos:pos + n]))
        pos += n
    return out


class PrefixShare:
    def __init__(self, writer: Executor, reader: Executor, index: ApproxIndex, *,
                 flush_ms: float = 10.0, maxlen: int = 50_000, block_ms: int = 500) -> None:
        self.writer = writer
        self.reader = reader
        self.index = index
        self.id = uuid.uuid4().hex[:16].encode()
        self.flush_s = flush_ms / 1000.0
        self.maxlen = maxlen
        self.block_ms = block_ms
        self._pending: list[tuple[str, bytes, bytes]] = []
        self.sent = self.received = 0
        index.on_record = self.publish

    def publish(self, url: str, hashes: Sequence[int], weights: Sequence[int]) -> None:
        """This replica recorded these index entries for ``url`` (called by the index on every
        record: the entries' hashes and the blocks each stands for)."""
        if hashes:
            self._pending.append((url, array("Q", hashes).tobytes(), bytes(weights)))

    async def _flush_loop(self) -> None:
        while True:
            await asyncio.sleep(self.flush_s)
            if not self._pending:
                continue
            batch, self._pending = self._pending, []
            try:
                await self.writer.execute("XADD", STREAM, "MAXLEN", "~", self.maxlen, "*",
                                          "r", self.id, "d", pack(batch))
                self.sent += len(batch)
            except (OSError, TimeoutError, ConnectionError) as exc:
                log.debug("prefix hints not shared: %s", exc)
            except Exception as exc:  # a Redis error reply: keep routing
                log.warning("prefix hints not shared: %s", exc)

    async def _follow_loop(self) -> None:
        last = b"$"
        while True:
            try:
                reply = await self.reader.execute("XREAD", "COUNT", 256, "BLOCK",
                                                  self.block_ms, "STREAMS", STREAM, last)
            except Exception as exc:  # unreachable, or an error reply
                log.debug("prefix hints unavailable: %s", exc)
                await asyncio.sleep(1.0)
                continue
            for _stream, entries in _streams(reply):
                for entry_id, fields in entries:
                    last = entry_id
                    f = _fields(fields)
                    if f.get(b"r") == self.id:
                        continue
                    for url, hashes, weights in unpack(f.get(b"d", b"")):
                        self.index.record_remote(url, hashes, weights)
                        self.received += 1

    async def run(self) -> None:
        tasks = [asyncio.ensure_future(self._flush_loop()),
                 asyncio.ensure_future(self._follow_loop())]
        try:
            await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()
            for t in tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await t


def _streams(reply: object) -> list[tuple[bytes, list[tuple[bytes, list[bytes]]]]]:
    """XREAD's reply as a list (RESP2 arrays, or redis-py's dict on a cluster)."""
    if reply is None:
        return []
    if isinstance(reply, dict):
        return list(reply.items())
    return [(s[0], s[1]) for s in reply]  # type: ignore[attr-defined]


def _fields(fields: object) -> dict[bytes, bytes]:
    if isinstance(fields, dict):
        return {k if isinstance(k, bytes) else str(k).encode(): v for k, v in fields.items()}
    it = iter(fields)  # type: ignore[call-overload]
    return dict(zip(it, it, strict=False))
