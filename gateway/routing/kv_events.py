"""Follow an engine's KV-cache events over ZMQ (vLLM's publisher, or the reference backend's,
which speaks the same format) and keep the precise prefix index exact.

*Wire format* (``vllm/distributed/kv_events.py``, vLLM 0.32): the PUB socket sends
``[topic, seq (8 bytes big-endian), payload]``; the payload is msgpack ``[ts, [event, ...],
data_parallel_rank]``; an event is a map tagged by ``type`` (``BlockStored``,
``BlockRemoved``, ``AllBlocksCleared``). Older vLLMs sent each event as an array
``[type, field, ...]`` in declaration order: both decode to ``EngineEvent``.

*Addresses* are the ones the engine was given, read with vLLM's rule: a wildcard or IPv6
address and ``ipc://`` make the engine bind, so the gateway connects (to the endpoint's own host
for a wildcard); any other ``tcp://host:port`` makes the engine connect, so the gateway binds
there. The replay socket always binds on the engine's side.

*Sequence numbers.* On start the subscriber asks the replay socket for everything from 0, so an
engine that cached blocks before the gateway came up is indexed at once; a gap in the sequence
is filled from the replay socket; a sequence that goes back (with a newer timestamp) means the
engine restarted, and its index is rebuilt from what the restarted engine reports. What cannot
be recovered (no replay socket, or the engine's buffer no longer has it) clears the endpoint's
index, which then under-states the cache rather than claims blocks the engine has dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import msgpack
import zmq
import zmq.asyncio

from gateway.config.endpoint import KVEvents

log = logging.getLogger("tokengate.routing.kv_events")
END_SEQ = (-1).to_bytes(8, "big", signed=True)
REPLAY_TIMEOUT_S = 2.0
IDLE_CHECK_S = 0.5  # no event for this long: ask the replay socket whether any were missed
_ORDER = {
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                    "medium", "lora_name", "extra_keys"),
    "BlockRemoved": ("block_hashes", "medium"),
    "AllBlocksCleared": (),
}


@dataclass(slots=True)
class EngineEvent:
    type: str
    block_hashes: list[Any] = field(default_factory=list)
    parent_block_hash: Any = None
    token_ids: list[int] = field(default_factory=list)
    block_size: int = 0
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None


class DecodeError(ValueError):
    pass


def _event(raw: Any) -> EngineEvent | None:
    if isinstance(raw, dict):
        kind = raw.get("type")
        fields = {k: raw[k] for k in _ORDER.get(str(kind), ()) if k in raw}
    elif isinstance(raw, list | tuple) and raw:
        kind = raw[0]
        fields = dict(zip(_ORDER.get(str(kind), ()), raw[1:], strict=False))
    else:
        raise DecodeError(f"an event is a map or an array, got {type(raw).__name__}")
    if kind not in _ORDER:
        return None  # a kind this gateway does not know: newer engines may add some
    e = EngineEvent(str(kind), **fields)
    if not isinstance(e.block_hashes, list) or not isinstance(e.token_ids, list):
        raise DecodeError(f"{kind}: block_hashes and token_ids must be arrays")
    return e


def decode_batch(payload: bytes) -> tuple[float, list[EngineEvent]]:
    """(timestamp, events) of one published batch."""
    try:
        raw = msgpack.unpackb(payload, strict_map_key=False, use_list=True)
    except (ValueError, msgpack.UnpackException) as exc:
        raise DecodeError(f"not msgpack: {exc}") from None
    if not isinstance(raw, list) or len(raw) < 2 or not isinstance(raw[1], list):
        raise DecodeError("a batch is [ts, [events], dp_rank]")
    events = [e for e in (_event(x) for x in raw[1]) if e is not None]
    return float(raw[0]), events


def engine_binds(endpoint: str) -> bool:
    """vLLM's rule (``ZmqEventPublisher._is_bind_endpoint``)."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def connect_address(endpoint: str, engine_url: str) -> str:
    """Where to connect to an engine that binds ``endpoint``: a wildcard host becomes the
    engine's own host (from its URL), never anything a request said."""
    if "://*:" in endpoint or "://[::]:" in endpoint:
        host = urlsplit(engine_url).hostname or "127.0.0.1"
        host = f"[{host}]" if ":" in host else host
        return f"tcp://{host}:{endpoint.rsplit(':', 1)[1]}"
    return endpoint


def _socket(ctx: zmq.asyncio.Context, kind: int, address: str) -> zmq.asyncio.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    if "[" in address:
        sock.setsockopt(zmq.IPV6, 1)
    return sock


Apply = Callable[[str, list[EngineEvent]], None]


@dataclass(slots=True)
class SubscriberStats:
    connected: bool = False
    batches: int = 0
    last_seq: int | None = None
    replays: int = 0
    gaps: int = 0
    restarts: int = 0
    lost: int = 0  # times the index was cleared because events could not be recovered
    errors: int = 0


class KVEventSubscriber:
    """One engine's event stream, applied to the index through ``apply``/``clear``."""

    def __init__(self, url: str, config: KVEvents, apply: Apply,
                 clear: Callable[[str], None]) -> None:
        self.url = url
        self.config = config
        self._apply = apply
        self._clear = clear
        self.stats = SubscriberStats()
        self._last_ts = 0.0
        # A batch that arrived after a gap, held while the gap is filled from the replay socket.
        self._pending: tuple[int, int] | None = None
        self._held: tuple[int, float, list[EngineEvent]] = (0, 0.0, [])

    async def run(self, ctx: zmq.asyncio.Context) -> None:
        cfg = self.config
        sub = _socket(ctx, zmq.SUB, cfg.endpoint)
        sub.setsockopt(zmq.SUBSCRIBE, cfg.topic.encode())
        try:
            if engine_binds(cfg.endpoint):
                sub.connect(connect_address(cfg.endpoint, self.url))
            else:
                sub.bind(cfg.endpoint)
            self.stats.connected = True
            await self._catch_up(ctx, 0, None)
            while True:
                try:
                    frames = await asyncio.wait_for(sub.recv_multipart(), IDLE_CHECK_S)
                except TimeoutError:
                    # Quiet: ask the replay socket for anything newer. A PUB/SUB join takes a
                    # few hundred ms, and what an engine publishes meanwhile never arrives.
                    if cfg.replay is not None:
                        await self._catch_up(ctx, 0, None, quiet=True)
                    continue
                self._on_message(frames)
                if self._pending is not None:
                    start, until = self._pending
                    self._pending = None
                    await self._catch_up(ctx, start, until)
                    self._handle(*self._held)
        finally:
            self.stats.connected = False
            sub.close(0)

    def _on_message(self, frames: list[bytes]) -> None:
        if len(frames) != 3 or len(frames[1]) != 8:
            self.stats.errors += 1
            return
        seq = int.from_bytes(frames[1], "big")
        try:
            ts, events = decode_batch(frames[2])
        except DecodeError as exc:
            self.stats.errors += 1
            log.warning("kv events from %s: batch %d: %s", self.url, seq, exc)
            return
        last = self.stats.last_seq
        if last is not None and seq <= last:
            if ts <= self._last_ts:
                return  # already applied (it came through the replay socket too)
            self._restarted(f"its sequence went back from {last} to {seq}")
            if seq > 0:
                self._pending, self._held = (0, seq), (seq, ts, events)
                return
        elif last is not None and seq > last + 1:
            self.stats.gaps += 1
            self._pending, self._held = (last + 1, seq), (seq, ts, events)
            return
        self._handle(seq, ts, events)

    def _handle(self, seq: int, ts: float, events: list[EngineEvent]) -> None:
        if self.stats.last_seq is not None and seq <= self.stats.last_seq:
            return
        self._apply(self.url, events)
        self.stats.batches += 1
        self.stats.last_seq = seq
        self._last_ts = max(self._last_ts, ts)

    async def _replay(self, ctx: zmq.asyncio.Context, start: int
                      ) -> list[tuple[int, float, list[EngineEvent]]] | None:
        """Every batch the engine still keeps from ``start`` on; None when it has no replay
        socket or it did not answer."""
        cfg = self.config
        if cfg.replay is None:
            return None
        dealer = _socket(ctx, zmq.DEALER, cfg.replay)
        out: list[tuple[int, float, list[EngineEvent]]] = []
        try:
            dealer.connect(connect_address(cfg.replay, self.url) if engine_binds(cfg.replay)
                           else cfg.replay)
            await dealer.send_multipart([b"", start.to_bytes(8, "big")])
            while True:
                frames = await asyncio.wait_for(dealer.recv_multipart(), REPLAY_TIMEOUT_S)
                if len(frames) != 4:
                    continue
                _, _, seq_b, payload = frames
                if seq_b == END_SEQ:
                    return out
                try:
                    ts, events = decode_batch(payload)
                except DecodeError:
                    self.stats.errors += 1
                    continue
                out.append((int.from_bytes(seq_b, "big"), ts, events))
        except TimeoutError:
            log.warning("kv events from %s: the replay socket %s did not answer in %.0f s",
                        self.url, cfg.replay, REPLAY_TIMEOUT_S)
            return None
        finally:
            dealer.close(0)

    async def _catch_up(self, ctx: zmq.asyncio.Context, start: int, until: int | None,
                        quiet: bool = False) -> None:
        """Apply batches [start, until) from the replay socket. ``until`` None is a check for
        news (at start, and whenever the stream is quiet); otherwise a gap must be filled, and
        what cannot be clears the index."""
        if not quiet:
            self.stats.replays += 1
        last = self.stats.last_seq
        probe = until is None and last is not None
        # A check for news asks from the last batch applied: an engine that still has it
        # answers it first (same timestamp); one that restarted does not.
        got = await self._replay(ctx, last if probe and last is not None else start)
        if got is None:
            if until is not None:
                self._lose(f"events {start}..{until - 1} missed and no replay answered")
            return
        if probe:
            if not got or got[0][0] != last or got[0][1] != self._last_ts:
                if got and got[0][0] > (last or 0):
                    self._lose(f"the engine no longer holds events after {last}")
                else:
                    self._restarted(f"its replay no longer has batch {last}")
                    got = await self._replay(ctx, 0) or []
            else:
                got = got[1:]
        elif got and got[0][0] > start and (until is not None or start > 0):
            self._lose(f"the engine no longer holds events {start}..{got[0][0] - 1}")
        for seq, ts, events in got:
            if until is None or seq < until:
                self._handle(seq, ts, events)

    def _restarted(self, why: str) -> None:
        self.stats.restarts += 1
        log.warning("kv events from %s: the engine restarted (%s); rebuilding its index",
                    self.url, why)
        self._clear(self.url)
        self.stats.last_seq = None
        self._last_ts = 0.0

    def _lose(self, why: str) -> None:
        self.stats.lost += 1
        log.warning("kv events from %s: %s; its index is cleared and rebuilt from new events",
                    self.url, why)
        self._clear(self.url)


class KVEventFollowers:
    """Every followed endpoint's subscriber task (owned by the fleet)."""

    def __init__(self) -> None:
        self._ctx: zmq.asyncio.Context | None = None
        self.subscribers: dict[str, KVEventSubscriber] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}

    def follow(self, url: str, config: KVEvents, apply: Apply,
               clear: Callable[[str], None]) -> None:
        t = self._tasks.get(url)
        old = self.subscribers.get(url)
        if t is not None and not t.done() and old is not None and old.config == config:
            return
        if t is not None:
            t.cancel()
        if self._ctx is None:
            self._ctx = zmq.asyncio.Context()
        sub = KVEventSubscriber(url, config, apply, clear)
        self.subscribers[url] = sub
        self._tasks[url] = asyncio.ensure_future(self._supervise(sub))

    async def _supervise(self, sub: KVEventSubscriber) -> None:
        assert self._ctx is not None
        while True:
            try:
                await sub.run(self._ctx)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a bad address, a closed socket: say so, then retry
                sub.stats.errors += 1
                log.warning("kv events from %s (%s): %s: %s", sub.url, sub.config.endpoint,
                            type(exc).__name__, exc)
            await asyncio.sleep(1.0)

    def drop(self, url: str) -> None:
        t = self._tasks.pop(url, None)
        self.subscribers.pop(url, None)
        if t is not None:
            t.cancel()

    async def close(self) -> None:
        tasks = list(self._tasks.values())
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._tasks.clear()
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
