"""The gateway's KV-event subscriber against a real ZMQ publisher (the reference backend's,
which speaks vLLM's wire format): history caught up from the replay socket, a lost batch
recovered, a restarted engine re-indexed, and an unrecoverable gap said and cleared."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import zmq

from backend.block_pool import KVEvent
from backend.events import KVEventPublisher, KVEventsConfig
from gateway.config.endpoint import KVEvents
from gateway.routing.kv_events import KVEventFollowers
from gateway.routing.prefix import PreciseIndex, block_hashes
from protocol.kv_hash import root_hash
from protocol.loopback import free_port

URL = "http://127.0.0.1:9/v1"
ROOT = root_hash("m")
BS = 4


def blocks(tokens: list[int], parent: int | None = None, salt: int = 0
           ) -> list[KVEvent]:
    """Stored events for ``tokens`` (engine hashes of our own invention, as vLLM's are)."""
    out, prev = [], parent
    for i in range(0, len(tokens), BS):
        h = (salt << 32) + tokens[i] * 1000 + i
        out.append(KVEvent("BlockStored", (h,), prev, tuple(tokens[i:i + BS])))
        prev = h
    return out


async def until(pred: Callable[[], bool], timeout_s: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not pred():
        assert loop.time() < deadline, "condition not reached"
        await asyncio.sleep(0.02)


def publisher(pub: int, replay: int | None) -> KVEventPublisher:
    p = KVEventPublisher(BS)
    p.start(KVEventsConfig(f"tcp://127.0.0.1:{pub}",
                           f"tcp://127.0.0.1:{replay}" if replay else None, "kv"))
    return p


async def test_history_gaps_and_restarts_keep_the_index_exact() -> None:
    pub_port, replay_port = free_port(), free_port()
    idx = PreciseIndex()
    idx.set_root(URL, ROOT)
    doc = list(range(1, 17))  # 4 blocks
    ours = block_hashes(doc, BS, ROOT)
    p = publisher(pub_port, replay_port)
    events = blocks(doc)
    p.publish(events[:2])  # published before anyone listens: only the replay socket has it
    followers = KVEventFollowers()
    followers.follow(URL, KVEvents(f"tcp://127.0.0.1:{pub_port}",
                                   f"tcp://127.0.0.1:{replay_port}", "kv"),
                     idx.apply, idx.clear)
    try:
        await until(lambda: idx.matched(URL, ours) == 2)
        # A batch lost on the way (the PUB socket drops it; the replay buffer keeps it),
        # then one that arrives: the gap is filled from the replay socket.
        sock: Any = p._pub
        real = sock.send_multipart
        sock.send_multipart = lambda *a, **k: None
        p.publish(events[2:3])
        sock.send_multipart = real
        await asyncio.sleep(0.6)  # let the subscriber's join finish
        p.publish(events[3:])
        await until(lambda: idx.matched(URL, ours) == 4)
        stats = followers.subscribers[URL].stats
        assert stats.lost == 0 and stats.last_seq == 2
        # The engine restarts on the same ports: its sequence starts again at 0.
        await p.close()
        await asyncio.sleep(0.1)
        p = publisher(pub_port, replay_port)
        other = list(range(50, 58))
        p.publish(blocks(other, salt=1))
        await until(lambda: idx.matched(URL, block_hashes(other, BS, ROOT)) == 2)
        assert idx.matched(URL, ours) == 0  # what the old process held is gone
        assert stats.restarts == 1 and idx.size(URL) == 2
    finally:
        await followers.close()
        await p.close()


async def test_without_a_replay_socket_a_gap_clears_the_index() -> None:
    pub_port = free_port()
    idx = PreciseIndex()
    idx.set_root(URL, ROOT)
    p = publisher(pub_port, None)
    followers = KVEventFollowers()
    followers.follow(URL, KVEvents(f"tcp://127.0.0.1:{pub_port}", None, "kv"), idx.apply,
                     idx.clear)
    try:
        doc = list(range(1, 13))
        ev = blocks(doc)
        for _ in range(100):  # until the PUB/SUB join is done and one batch got through
            p.publish(ev[:1])
            await asyncio.sleep(0.02)
            if idx.size(URL):
                break
        sock: Any = p._pub
        real = sock.send_multipart
        sock.send_multipart = lambda *a, **k: None
        p.publish(ev[1:2])
        sock.send_multipart = real
        p.publish(ev[2:])
        stats = followers.subscribers[URL].stats
        await until(lambda: stats.lost == 1)
        # Cleared, then rebuilt from what came after: block 3 alone cannot be placed (its
        # parent was in the lost batch), so nothing claims blocks the engine may have dropped.
        assert idx.matched(URL, block_hashes(doc, BS, ROOT)) == 0
    finally:
        await followers.close()
        await p.close()


def test_a_publisher_that_connects_reaches_a_bound_subscriber() -> None:
    """vLLM's rule for ``tcp://127.0.0.1:P``: the engine connects, the subscriber binds."""
    port = free_port()
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.bind(f"tcp://127.0.0.1:{port}")

    async def go() -> None:
        p = publisher(port, None)
        try:
            for _ in range(100):
                p.publish(blocks([1, 2, 3, 4]))
                await asyncio.sleep(0.02)
                if sub.poll(0):
                    return
            raise AssertionError("nothing arrived")
        finally:
            await p.close()

    try:
        asyncio.run(go())
    finally:
        sub.close(0)
        ctx.term()


def test_chained_hashes_are_hash_block_per_block_whatever_the_feed() -> None:
    """The chain (one BLAKE2b call per block over bytes) and ``hash_block`` name every block
    by the documented layout, salted first block included, and the router's incremental feed (a
    prompt arriving in pieces that cut blocks anywhere) gives the same hashes as one pass."""
    import hashlib
    from array import array

    from gateway.routing.prefix import block_hashes, extend_hashes
    from protocol.kv_hash import chain_hashes, extend_block_hashes, hash_block, root_hash

    toks = [(i * 7919) % 50_000 for i in range(16 * 9 + 5)]
    root = root_hash("m")
    for salt in ("", "tenant-a"):
        expected: list[int] = []  # the layout, spelled out: every process must agree on it
        parent = int(root)
        for i in range(9):
            extra = salt.encode() if i == 0 else b""
            h = hashlib.blake2b(parent.to_bytes(8, "little") + len(extra).to_bytes(2, "little")
                                + extra + array("I", toks[i * 16:(i + 1) * 16]).tobytes(),
                                digest_size=8)
            parent = int.from_bytes(h.digest(), "little")
            expected.append(parent)
            assert hash_block(expected[-2] if i else root, toks[i * 16:(i + 1) * 16],
                              extra) == parent
        data = array("I", toks[:16 * 9]).tobytes()
        assert chain_hashes(root, data, 64, salt.encode()) == expected
        assert extend_block_hashes([], toks, 16, root, salt or None) == expected
        assert block_hashes(toks, 16, root, salt or None) == expected
        half = extend_block_hashes([], toks[:16 * 4 + 3], 16, root, salt or None)
        assert extend_block_hashes(half, toks, 16, root, salt or None) == expected
        hashes: array[int] = array("Q")
        tail: array[int] = array("I")
        done = 0
        for cut in (5, 45, 46, 130, len(toks)):
            extend_hashes(hashes, tail, toks[done:cut], 16, root, salt.encode())
            done = cut
        assert list(hashes) == expected
        assert list(tail) == toks[16 * 9:]
