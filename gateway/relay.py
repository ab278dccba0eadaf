"""Relaying one upstream response to the client, chunk by chunk, as it arrives.

Server-sent events are forwarded one event at a time (never buffered beyond the event being
read). On the way through, the relay stamps the first content chunk (TTFT), counts content
chunks (one token each on vLLM-style servers) for progressive charging (every N tokens or T
seconds, whichever comes first), picks up ``usage`` from
the final chunk (and drops that chunk unless the client asked for it), and renames the upstream
model to the one the client asked for. A stream that breaks after its first byte ends with an
SSE error event and ``[DONE]``, cleanly.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

import aiohttp
import orjson
from aiohttp import web

from gateway.migrate import Live, shift_usage, stream_id
from gateway.upstream import UpstreamResponse


@dataclass(slots=True)
class RelayResult:
    """What the relay saw: enough to settle quota and feed metrics."""

    status: int = 0
    first_token_at: float | None = None
    last_token_at: float | None = None
    chunks: int = 0  # content chunks (≈ tokens)
    usage: dict[str, Any] | None = None
    broken: bool = False  # the upstream stream broke after the first byte
    bytes_sent: bool = False
    client_gone: bool = False  # the client disconnected mid-stream
    migrated: bool = False  # cut on purpose to continue elsewhere (gateway.migrate)
    stream_id: bytes | None = None  # the completion id the client sees


class Tally(Protocol):
    """Where the relay counts the content chunks it passes (an endpoint's live state)."""

    streamed: int


def _rename(data: bytes, upstream: bytes, served: bytes) -> bytes:
    if upstream == served:
        return data
    spaced_up = upstream.replace(b'":"', b'": "', 1)
    return data.replace(upstream, served).replace(spaced_up,
                                                  served.replace(b'":"', b'": "', 1))


def _usage_of(payload: bytes) -> dict[str, Any] | None:
    if b'"usage"' not in payload:
        return None
    try:
        obj = orjson.loads(payload)
    except orjson.JSONDecodeError:
        return None
    u = obj.get("usage") if isinstance(obj, dict) else None
    return u if isinstance(u, dict) else None


def _has_content(payload: bytes) -> bool:
    # Cheap test on the raw bytes: a chunk with text or delta content that is not empty.
    return (b'"content":"' in payload and b'"content":""' not in payload) or \
        (b'"text":"' in payload and b'"text":""' not in payload)


class _Stall:
    """The stream's stall and total deadlines, re-armed by every event at the cost of a clock
    read: ``last`` is only recorded; the one timer re-arms itself when it fires early.
    (``asyncio.Timeout.reschedule`` per event made the relay 4x slower: 6.8 against 1.7 µs.)"""

    def __init__(self, gap_s: float, end: float) -> None:
        self.loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None
        self.task = task
        self.gap_s = gap_s
        self.end = end
        self.last = self.loop.time()
        self.fired = False
        self.handle = self.loop.call_at(self._due(), self._check)

    def _due(self) -> float:
        return min(self.end, self.last + self.gap_s)

    def _check(self) -> None:
        due = self._due()
        if self.loop.time() >= due - 1e-4:
            self.fired = True
            self.task.cancel()
        else:
            self.handle = self.loop.call_at(due, self._check)

    def uncancel(self) -> None:
        self.task.uncancel()

    def close(self) -> None:
        self.handle.cancel()


async def relay_stream(
    lines: AsyncIterator[bytes],
    resp: web.StreamResponse,
    *,
    upstream_model: str,
    served_model: str,
    pass_usage: bool,
    on_tokens: Callable[[int], Awaitable[None]] | None = None,
    every: int = 256,
    every_s: float = 1.0,
    into: RelayResult | None = None,
    on_first: Callable[[], None] | None = None,
    gap_s: float = 60.0,
    deadline_s: float = 600.0,
    live: Live | None = None,
    usage_shift: int = 0,
    tally: Tally | None = None,
) -> RelayResult:
    """Copy an SSE response to ``resp`` (already prepared) event by event.

    Progress is recorded in ``into`` as it happens, so a caller interrupted mid-stream (the
    client went away) still knows what was streamed. An upstream silent for ``gap_s``, or
    still streaming ``deadline_s`` from now, is cut off with an SSE error event.

    ``live`` (pools that may migrate streams) keeps the content chunks and, when the stream is
    cut to migrate, makes the relay return quietly (``migrated``) for the caller to continue
    it; a continuation passes ``usage_shift`` (tokens generated before it) and ``into`` with
    the client's ``stream_id``, which replaces the new upstream's id. ``tally`` counts
    content chunks per endpoint (its current decode step, a routing feature).
    """
    res = into if into is not None else RelayResult(status=200)
    up_tag = f'"model":"{upstream_model}"'.encode()
    served_tag = f'"model":"{served_model}"'.encode()
    event: list[bytes] = []
    next_charge = every
    next_charge_at = time.perf_counter() + every_s
    loop = asyncio.get_running_loop()
    end = loop.time() + max(deadline_s, 0.001)
    swap: tuple[bytes, bytes] | None = None  # (upstream id, client's id) in a continuation
    stall = _Stall(gap_s, end)
    try:
        try:
            async for line in lines:
                stall.last = loop.time()
                if line not in (b"\n", b"\r\n"):
                    event.append(line)
                    continue
                if not event:
                    continue
                data = b"".join(event)
                event.clear()
                payload = data[5:].strip() if data.startswith(b"data:") else b""
                forward = True
                if payload and payload != b"[DONE]":
                    if live is not None:
                        sid = stream_id(payload)
                        if res.stream_id is None:
                            res.stream_id = sid
                        elif swap is None and sid is not None and sid != res.stream_id:
                            swap = (sid, res.stream_id)
                        if swap is not None:
                            data = data.replace(swap[0], swap[1])
                    usage = _usage_of(payload)
                    if usage is not None:
                        if usage_shift:
                            shifted, usage = shift_usage(payload, usage_shift)
                            if swap is not None:
                                shifted = shifted.replace(swap[0], swap[1])
                            data = b"data: " + shifted + b"\n"
                        res.usage = usage
                        if b'"choices":[]' in payload and not pass_usage:
                            forward = False
                    if _has_content(payload):
                        if live is not None:
                            live.payloads.append(payload)
                        now = time.perf_counter()
                        if res.first_token_at is None:
                            res.first_token_at = now
                            if on_first is not None:
                                on_first()
                        res.last_token_at = now
                        res.chunks += 1
                        if tally is not None:
                            tally.streamed += 1
                if forward:
                    await resp.write(_rename(data, up_tag, served_tag) + b"\n")
                    res.bytes_sent = True
                if on_tokens is not None and res.chunks and (
                        res.chunks >= next_charge or
                        (res.last_token_at or 0.0) >= next_charge_at):
                    next_charge = res.chunks + every
                    next_charge_at = time.perf_counter() + every_s
                    await on_tokens(res.chunks)
        except asyncio.CancelledError:
            if not stall.fired:
                raise
            stall.uncancel()
            raise TimeoutError from None
        finally:
            stall.close()
    except ConnectionResetError:
        # Writing to the client failed: it went away. Stop; the caller settles what was sent.
        res.client_gone = True
    except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError, ConnectionError,
            TimeoutError) as exc:
        if live is not None and live.migrating and not isinstance(exc, TimeoutError):
            res.migrated = True  # the caller continues the stream elsewhere
            return res
        res.broken = True
        if isinstance(exc, TimeoutError):
            what = ("the request's total timeout passed" if loop.time() >= end - 1e-3 else
                    f"no token for {gap_s:g} s")
            message, code = f"upstream stalled: {what}", "upstream_timeout"
        else:
            message, code = "upstream stream broke: the connection closed", "upstream_error"
        err = {"error": {"message": message, "type": "server_error", "param": None,
                         "code": code}}
        try:
            await resp.write(b"data: " + orjson.dumps(err) + b"\n\ndata: [DONE]\n\n")
        except ConnectionResetError:
            res.client_gone = True
    return res


async def relay_body(upstream: UpstreamResponse, *, upstream_model: str,
                     served_model: str) -> tuple[bytes, RelayResult]:
    """Read a non-streamed response; pick up its usage and rename the model."""
    body = await upstream.read()
    res = RelayResult(status=upstream.status)
    res.usage = _usage_of(body)
    now = time.perf_counter()
    res.first_token_at = res.last_token_at = now
    up_tag = f'"model":"{upstream_model}"'.encode()
    served_tag = f'"model":"{served_model}"'.encode()
    return _rename(body, up_tag, served_tag), res
