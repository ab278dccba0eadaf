"""The KV event stream over ZMQ, in vLLM's own wire format, so one subscriber serves both.

vLLM's ``ZmqEventPublisher`` (``vllm/distributed/kv_events.py``, 0.32): each batch of block-pool
events goes out on a PUB socket as ``[topic, seq (8 bytes, big-endian), payload]`` where the
payload is msgpack ``[ts, [event, ...], data_parallel_rank]`` and each event a map tagged by
``type``: ``BlockStored`` (``block_hashes``, ``parent_block_hash``, ``token_ids``,
``block_size``, ``lora_id``, ``medium``, ``lora_name``, ``extra_keys``: the cache salt of a
first block), ``BlockRemoved`` (``block_hashes``, ``medium``) and ``AllBlocksCleared``. The last
``buffer_steps`` batches are kept for a ROUTER *replay* socket: a request ``[start_seq]``
is answered with every kept batch from that sequence on, then ``[b"", END_SEQ, b""]``.

Addresses follow vLLM's rule: ``tcp://*:P``, ``tcp://[::…]:P`` and ``ipc://`` bind; any other
``tcp://host:P`` connects (the subscriber binds there). The replay socket always binds. This is
``--kv-events-config`` of the reference backend, with vLLM's JSON keys.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import msgpack
import zmq
import zmq.asyncio

from backend.block_pool import KVEvent

log = logging.getLogger("tokengate.backend.kv_events")
END_SEQ = (-1).to_bytes(8, "big", signed=True)


@dataclass(frozen=True, slots=True)
class KVEventsConfig:
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    topic: str = ""
    buffer_steps: int = 10_000
    hwm: int = 100_000

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> KVEventsConfig | None:
        """vLLM's ``--kv-events-config`` object; None when events are not enabled."""
        if not raw.get("enable_kv_cache_events", False):
            return None
        publisher = raw.get("publisher", "zmq")
        if publisher != "zmq":
            raise ValueError(f"kv events publisher {publisher!r}: only 'zmq' is supported")
        return cls(str(raw.get("endpoint", "tcp://*:5557")),
                   raw.get("replay_endpoint") or None, str(raw.get("topic", "")),
                   int(raw.get("buffer_steps", 10_000)), int(raw.get("hwm", 100_000)))


def binds(endpoint: str) -> bool:
    """vLLM's rule: wildcard and IPv6 addresses and ipc/inproc bind; the rest connect."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def encode_event(e: KVEvent, block_size: int) -> dict[str, Any]:
    if e.kind == "BlockStored":
        return {"type": "BlockStored", "block_hashes": list(e.block_hashes),
                "parent_block_hash": e.parent_block_hash, "token_ids": list(e.token_ids),
                "block_size": e.block_size or block_size, "lora_id": None, "medium": e.medium,
                "lora_name": None,
                "extra_keys": [[e.salt] if e.salt else None] * len(e.block_hashes)}
    if e.kind == "BlockRemoved":
        return {"type": "BlockRemoved", "block_hashes": list(e.block_hashes),
                "medium": e.medium}
    return {"type": "AllBlocksCleared"}


def _socket(ctx: zmq.asyncio.Context, kind: int, endpoint: str, bind: bool) -> zmq.asyncio.Socket:
    """A socket bound or connected to ``endpoint``; closed again when that fails, which is
    raised as ``OSError`` naming the endpoint."""
    sock = ctx.socket(kind)
    try:
        if "[" in endpoint or "::" in endpoint:
            sock.setsockopt(zmq.IPV6, 1)
        sock.setsockopt(zmq.LINGER, 0)
        if bind:
            sock.bind(endpoint)
        else:
            sock.connect(endpoint)
    except zmq.ZMQError as exc:
        sock.close(0)
        verb = "bind" if bind else "connect"
        raise OSError(f"kv events: cannot {verb} {endpoint}: {exc.strerror}") from None
    return sock


class KVEventPublisher:
    """Publishes block-pool events; a no-op until ``start`` is given a configuration."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.config: KVEventsConfig | None = None
        self._seq = 0
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=1)
        self._ctx: zmq.asyncio.Context | None = None
        self._pub: zmq.asyncio.Socket | None = None
        self._replay_task: asyncio.Task[None] | None = None
        self.dropped = 0

    @property
    def next_seq(self) -> int:
        return self._seq

    def start(self, config: KVEventsConfig) -> None:
        """Opens the sockets; when one cannot be opened, none stays open (``OSError``)."""
        ctx = zmq.asyncio.Context()
        try:
            pub = _socket(ctx, zmq.PUB, config.endpoint, binds(config.endpoint))
            pub.setsockopt(zmq.SNDHWM, config.hwm)
            try:
                router = (_socket(ctx, zmq.ROUTER, config.replay_endpoint, True)
                          if config.replay_endpoint else None)
            except OSError:
                pub.close(0)
                raise
        except OSError:
            ctx.term()
            raise
        self.config = config
        self._buffer = deque(maxlen=config.buffer_steps)
        self._ctx, self._pub = ctx, pub
        if router is not None:
            self._replay_task = asyncio.ensure_future(self._serve_replay(router))

    def publish(self, events: Iterable[KVEvent]) -> None:
        batch = [encode_event(e, self.block_size) for e in events]
        if not batch or self._pub is None or self.config is None:
            return
        payload = msgpack.packb([time.time(), batch, 0])
        seq = self._seq
        self._seq += 1
        self._buffer.append((seq, payload))
        frames = [self.config.topic.encode(), seq.to_bytes(8, "big"), payload]
        try:
            self._pub.send_multipart(frames, flags=zmq.NOBLOCK)
        except zmq.Again:
            self.dropped += 1  # no subscriber keeps up: it will ask the replay socket

    async def _serve_replay(self, router: zmq.asyncio.Socket) -> None:
        topic = (self.config.topic if self.config else "").encode()
        try:
            while True:
                frame = await router.recv_multipart()
                if len(frame) != 3:
                    log.warning("invalid replay request (%d frames)", len(frame))
                    continue
                client, _, start = frame
                first = int.from_bytes(start, "big")
                for seq, payload in list(self._buffer):
                    if seq >= first:
                        await router.send_multipart([client, b"", topic, seq.to_bytes(8, "big"),
                                                     payload])
                await router.send_multipart([client, b"", b"", END_SEQ, b""])
        finally:
            router.close(0)

    async def close(self) -> None:
        if self._replay_task is not None:
            self._replay_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._replay_task
        if self._pub is not None:
            self._pub.close(0)
        if self._ctx is not None:
            self._ctx.term()
