"""Driving ``gateway.request.relay.relay_stream`` with the response body chunks Envoy streams to the
EPP: ``LineFeed`` is the relay's line iterator, fed one chunk at a time; ``Collected`` is
its sink, whose bytes go back to Envoy as that chunk's replacement. The relay renames the
model, drops a usage chunk the client did not ask for, counts tokens and picks up usage,
exactly as it does in ``tokengate serve``."""

from __future__ import annotations

import asyncio
from collections import deque


class LineFeed:
    """An async iterator of lines (each with its ``\\n``), fed by ``push``; ``drained`` is set
    whenever everything pushed has been taken (the relay waits for more)."""

    def __init__(self) -> None:
        self._lines: deque[bytes] = deque()
        self._tail = b""
        self._ended = False
        self._more = asyncio.Event()
        self.drained = asyncio.Event()

    def push(self, chunk: bytes, end: bool) -> None:
        data = self._tail + chunk
        *lines, self._tail = data.split(b"\n")
        self._lines.extend(line + b"\n" for line in lines)
        if end:
            if self._tail:
                self._lines.append(self._tail)
                self._tail = b""
            self._ended = True
        self.drained.clear()
        self._more.set()

    def __aiter__(self) -> LineFeed:
        return self

    async def __anext__(self) -> bytes:
        while not self._lines:
            if self._ended:
                self.drained.set()
                raise StopAsyncIteration
            self._more.clear()
            self.drained.set()
            await self._more.wait()
        return self._lines.popleft()


class Collected:
    """What the relay wrote since the last ``take``."""

    def __init__(self) -> None:
        self._parts: list[bytes] = []

    async def write(self, data: bytes) -> None:
        self._parts.append(data)

    def take(self) -> bytes:
        out = b"".join(self._parts)
        self._parts.clear()
        return out
