"""A lean pooled HTTP/1.1 client for the gateway's upstream calls (https goes via aiohttp).

aiohttp's client was a fifth of the gateway's CPU per request (request objects, cookie and
redirect handling, tracing hooks, a generic stream reader). Upstream calls here are always the
same shape: one POST with a JSON body on a keep-alive connection, a response framed by
Content-Length or chunked encoding, read whole or line by line (SSE). This client does exactly
that on an asyncio Protocol: the head is parsed once, the body is decoded as it arrives, and a
connection goes back to its pool only when its response was read to the end.

Errors: connecting raises ``OSError``/``TimeoutError``; a connection that closes mid-response
raises ``UpstreamBroken``.
"""

from __future__ import annotations

import asyncio
import socket
from collections import deque
from collections.abc import AsyncIterator, Mapping
from typing import cast
from urllib.parse import urlsplit

import aiohttp


class UpstreamBroken(ConnectionError):
    """The upstream closed the connection before its response ended."""


class _Conn(asyncio.Protocol):
    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.closed = False
        self._waiter: asyncio.Future[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # NOTE: uvloop's transports are not asyncio.Transport subclasses; do not check the type.
        self.transport = cast(asyncio.Transport, transport)
        sock = transport.get_extra_info("socket")
        if sock is not None:  # small SSE writes must not wait for delayed ACKs
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        self.buf += data
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def more(self) -> None:
        """Wait until more bytes arrive (or the connection closes)."""
        if self.closed:
            raise UpstreamBroken("upstream closed the connection")
        self._waiter = asyncio.get_running_loop().create_future()
        await self._waiter
        self._waiter = None
        if self._drained():
            raise UpstreamBroken("upstream closed the connection")

    def _drained(self) -> bool:
        return self.closed and not self.buf


class Response:
    """An upstream response whose body is read whole (``read``) or by lines (``lines``)."""

    def __init__(self, conn: _Conn, pool: deque[_Conn], status: int,
                 headers: dict[str, str]) -> None:
        self._conn = conn
        self._pool = pool
        self.status = status
        self.headers = headers
        te = headers.get("transfer-encoding", "").lower()
        self._chunked = "chunked" in te
        cl = headers.get("content-length")
        self._left = int(cl) if cl is not None and not self._chunked else None
        self._done = self._left == 0
        self._released = False

    async def _chunks(self) -> AsyncIterator[bytes]:
        """Decoded body pieces as they arrive."""
        c = self._conn
        if self._chunked:
            while True:
                while (i := c.buf.find(b"\r\n")) < 0:
                    await c.more()
                size = int(bytes(c.buf[:i]).split(b";", 1)[0], 16)
                while len(c.buf) < i + 2 + size + 2:
                    await c.more()
                data = bytes(c.buf[i + 2:i + 2 + size])
                del c.buf[:i + 2 + size + 2]
                if size == 0:
                    self._done = True
                    return
                yield data
        elif self._left is not None:
            while self._left > 0:
                if not c.buf:
                    await c.more()
                data = bytes(c.buf[:self._left])
                del c.buf[:len(data)]
                self._left -= len(data)
                yield data
            self._done = True
        else:  # delimited by the connection closing
            while True:
                if c.buf:
                    data = bytes(c.buf)
                    c.buf.clear()
                    yield data
                try:
                    await c.more()
                except UpstreamBroken:
                    self._done = True
                    return

    async def read(self) -> bytes:
        return b"".join([piece async for piece in self._chunks()])

    async def lines(self) -> AsyncIterator[bytes]:
        """The body split after each ``\\n`` (for server-sent events)."""
        rest = b""
        async for piece in self._chunks():
            data = rest + piece
            start = 0
            while (j := data.find(b"\n", start)) >= 0:
                yield data[start:j + 1]
                start = j + 1
            rest = data[start:]
        if rest:
            yield rest

    def abort(self) -> None:
        """Cut the connection now (the reader sees ``UpstreamBroken``; the upstream sees its
        client leave and frees the request)."""
        c = self._conn
        if c.transport is not None:
            c.transport.close()

    def release(self) -> None:
        """Return the connection to the pool if the response was read to its end."""
        if self._released:
            return
        self._released = True
        c = self._conn
        keep = self._done and not c.closed and not c.buf and \
            self.headers.get("connection", "").lower() != "close"
        if keep:
            self._pool.append(c)
        elif c.transport is not None:
            c.transport.close()


class AiohttpResponse:
    """The same interface over an aiohttp response (https upstreams)."""

    def __init__(self, resp: aiohttp.ClientResponse) -> None:
        self._r = resp
        self.status = resp.status
        self.headers = {k.lower(): v for k, v in resp.headers.items()}

    async def read(self) -> bytes:
        return await self._r.read()

    async def lines(self) -> AsyncIterator[bytes]:
        async for line in self._r.content:
            yield line

    def abort(self) -> None:
        self._r.close()

    def release(self) -> None:
        self._r.release()


UpstreamResponse = Response | AiohttpResponse


class UpstreamClient:
    def __init__(self) -> None:
        self._pools: dict[tuple[str, int], deque[_Conn]] = {}
        self._session: aiohttp.ClientSession | None = None

    async def post(self, url: str, body: bytes, headers: Mapping[str, str], *,
                   connect_timeout_s: float) -> UpstreamResponse:
        u = urlsplit(url)
        if u.scheme != "http":
            return await self._via_aiohttp(url, body, headers, connect_timeout_s)
        host, port = u.hostname or "127.0.0.1", u.port or 80
        pool = self._pools.setdefault((host, port), deque())
        path = (u.path or "/") + (f"?{u.query}" if u.query else "")
        head = [f"POST {path} HTTP/1.1", f"Host: {u.netloc}", f"Content-Length: {len(body)}",
                *(f"{k}: {v}" for k, v in headers.items()), "", ""]
        payload = "\r\n".join(head).encode() + body
        while pool:
            conn = pool.pop()
            if conn.closed or conn.transport is None or conn.transport.is_closing():
                continue
            try:
                return await self._exchange(conn, pool, payload)
            except UpstreamBroken:
                continue  # a kept-alive connection the upstream had closed: use a fresh one
        loop = asyncio.get_running_loop()
        _, conn = await asyncio.wait_for(loop.create_connection(_Conn, host, port),
                                         connect_timeout_s)
        return await self._exchange(conn, pool, payload)

    async def _exchange(self, conn: _Conn, pool: deque[_Conn], payload: bytes) -> Response:
        """Send a request and read its head; on any failure (including cancellation by a
        timeout) the connection is closed, never leaked nor pooled mid-exchange."""
        try:
            return await self._exchange_head(conn, pool, payload)
        except BaseException:
            if conn.transport is not None:
                conn.transport.close()
            raise

    async def _exchange_head(self, conn: _Conn, pool: deque[_Conn], payload: bytes
                             ) -> Response:
        assert conn.transport is not None
        conn.buf.clear()
        conn.transport.write(payload)
        while (end := conn.buf.find(b"\r\n\r\n")) < 0:
            await conn.more()
        head = bytes(conn.buf[:end]).decode("latin-1").split("\r\n")
        del conn.buf[:end + 4]
        status = int(head[0].split(" ", 2)[1])
        headers: dict[str, str] = {}
        for line in head[1:]:
            k, _, v = line.partition(":")
            headers[k.strip().lower()] = v.strip()
        return Response(conn, pool, status, headers)

    async def _via_aiohttp(self, url: str, body: bytes, headers: Mapping[str, str],
                           connect_timeout_s: float) -> AiohttpResponse:
        if self._session is None:
            self._session = aiohttp.ClientSession(auto_decompress=False,
                                                  cookie_jar=aiohttp.DummyCookieJar())
        r = await self._session.post(url, data=body, headers=dict(headers),
                                     timeout=aiohttp.ClientTimeout(sock_connect=connect_timeout_s))
        return AiohttpResponse(r)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
        for pool in self._pools.values():
            while pool:
                c = pool.pop()
                if c.transport is not None:
                    c.transport.close()
