"""A lean pooled HTTP/1.1 client for the gateway's upstream calls, http and https.

Upstream calls are always the same shape: one POST with a JSON body on a keep-alive
connection, a response read whole or line by line (SSE). This client does exactly that on an
asyncio Protocol and parses responses with llhttp (``httptools``, the parser behind uvicorn and
aiohttp's C path), so framing is never guessed: status line, headers, Content-Length, chunk
sizes and their CRLFs, trailers, interim ``1xx`` answers and keep-alive are llhttp's to judge.

The upstream is not trusted:

* a response head is capped (``MAX_HEAD_BYTES``, ``MAX_HEADERS``), a status outside 200-599
  after the interim answers is refused, ``101`` (an upgrade nobody asked for) too;
* body bytes are handed on as they arrive, never buffered whole: a read pauses the socket
  when ``HIGH_WATER`` bytes wait for the reader and resumes under ``LOW_WATER`` (back-pressure
  from the client through the relay to the upstream); ``read`` caps a whole body at
  ``MAX_BODY_BYTES``, ``lines`` an SSE line at ``MAX_LINE_BYTES``;
* the Host header is the URL's host and port only (never its userinfo).

Every failure is one of this module's exceptions, so the request path knows one error family:
``UpstreamConnectError`` (could not connect: refused, unreachable, TLS handshake failed),
``UpstreamBroken`` (the connection closed before the response ended) and
``UpstreamProtocolError`` (the answer is not valid HTTP/1.1, or over a limit). Timeouts are the
caller's (``TimeoutError``).
"""

from __future__ import annotations

import asyncio
import socket
import ssl
from collections import deque
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import cast
from urllib.parse import urlsplit

import httptools

MAX_HEAD_BYTES = 64 * 1024
MAX_HEADERS = 128
MAX_BODY_BYTES = 64 * 1024 * 1024
MAX_LINE_BYTES = 4 * 1024 * 1024
HIGH_WATER = 256 * 1024
LOW_WATER = 64 * 1024


class UpstreamError(Exception):
    """An upstream call failed; ``kind`` is ``connect``, ``broken`` or ``protocol``."""

    kind = "broken"


class UpstreamConnectError(UpstreamError):
    kind = "connect"


class UpstreamBroken(UpstreamError):
    """The upstream closed the connection before its response ended."""

    kind = "broken"


class UpstreamProtocolError(UpstreamError):
    """The upstream's answer is not valid HTTP/1.1, or exceeds a limit."""

    kind = "protocol"


class _Conn(asyncio.Protocol):
    """One connection and the response being parsed on it (llhttp's callbacks land here)."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.busy = False  # a request was sent and its response is not complete yet
        self.error: UpstreamError | None = None
        self._waiter: asyncio.Future[None] | None = None
        self.paused = False
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self.headers: dict[str, str] = {}
        self.head_bytes = 0  # bytes received while the head is incomplete
        self.header_bytes = 0  # the head's header lines
        self.head_done = False
        self.keep_alive = False
        self.interim = False
        self.complete = False
        self.pieces: deque[bytes] = deque()
        self.buffered = 0

    # -- asyncio.Protocol --------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # NOTE: uvloop's transports are not asyncio.Transport subclasses; do not check the type.
        self.transport = cast(asyncio.Transport, transport)
        sock = transport.get_extra_info("socket")
        if sock is not None:  # small SSE writes must not wait for delayed ACKs
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        if not self.busy or self.error is not None:
            # Bytes nobody asked for (after a complete response): the connection is unusable.
            self._fail(UpstreamProtocolError("the upstream sent data after its response"))
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(UpstreamProtocolError("the upstream switched protocols"))
        except httptools.HttpParserError as exc:
            cause = exc.__context__
            self._fail(cause if isinstance(cause, UpstreamError) else
                       UpstreamProtocolError(f"malformed response: {exc}"))
        else:
            if not self.head_done:
                self.head_bytes += len(data)
                if self.head_bytes > MAX_HEAD_BYTES:
                    self._fail(UpstreamProtocolError("response head too large"))
        self._wake()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._wake()

    # -- llhttp callbacks --------------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.head_done:
            return  # a trailer: parsed (and so checked) by llhttp, not used
        self.header_bytes += len(name) + len(value) + 4
        if len(self.headers) >= MAX_HEADERS or self.header_bytes > MAX_HEAD_BYTES:
            raise UpstreamProtocolError("response head too large")
        key = name.decode("latin-1").lower()
        v = value.decode("latin-1").strip()
        self.headers[key] = f"{self.headers[key]}, {v}" if key in self.headers else v

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if 100 <= status < 200 and status != 101:
            self.interim = True  # 100 Continue, 103 Early Hints: the final answer follows
            return
        if not 200 <= status <= 599:
            raise UpstreamProtocolError(f"invalid status {status}")
        self.status = status
        self.head_done = True
        # Asked now: llhttp resets its flags once the message completes.
        self.keep_alive = self.parser.should_keep_alive()

    def on_body(self, body: bytes) -> None:
        self.pieces.append(body)
        self.buffered += len(body)
        if self.buffered > HIGH_WATER and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()

    def on_message_complete(self) -> None:
        if self.interim:
            self.interim = False
            self.headers = {}
            self.header_bytes = 0
            return
        self.complete = True

    # -- for the reader ----------------------------------------------------------------------

    def _fail(self, err: UpstreamError) -> None:
        if self.error is None:
            self.error = err
        if self.transport is not None:
            self.transport.close()

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def take(self) -> bytes | None:
        """The next body piece, if one is waiting."""
        if not self.pieces:
            return None
        piece = self.pieces.popleft()
        self.buffered -= len(piece)
        if self.paused and self.buffered < LOW_WATER and self.transport is not None:
            self.paused = False
            self.transport.resume_reading()
        return piece

    async def more(self) -> None:
        """Wait for the parser to make progress; raise if the connection cannot make any
        (what was parsed before an error or a close is still read first)."""
        if self.error is not None:
            raise self.error
        if self.closed:
            raise UpstreamBroken("upstream closed the connection")
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None


class Response:
    """An upstream response whose body is read whole (``read``) or by lines (``lines``)."""

    def __init__(self, conn: _Conn, pool: deque[_Conn]) -> None:
        self._conn = conn
        self._pool = pool
        self.status = conn.status
        self.headers = conn.headers
        te = self.headers.get("transfer-encoding", "").lower()
        # Neither length nor chunks: the body ends when the connection closes.
        self._until_close = ("chunked" not in te and "content-length" not in self.headers
                             and self.status not in (204, 304))
        self._released = False

    async def _chunks(self) -> AsyncIterator[bytes]:
        """Decoded body pieces as they arrive."""
        c = self._conn
        while True:
            piece = c.take()
            if piece is not None:
                yield piece
                continue
            if c.complete:
                return
            if c.closed and c.error is None and self._until_close:
                c.complete = True
                return
            await c.more()

    async def read(self, limit: int = MAX_BODY_BYTES) -> bytes:
        out = bytearray()
        async for piece in self._chunks():
            out += piece
            if len(out) > limit:
                self.abort()
                raise UpstreamProtocolError(f"response body over {limit} bytes")
        return bytes(out)

    async def lines(self) -> AsyncIterator[bytes]:
        """The body split after each ``\\n`` (for server-sent events)."""
        rest = b""
        async for piece in self._chunks():
            data = rest + piece if rest else piece
            start = 0
            while (j := data.find(b"\n", start)) >= 0:
                yield data[start:j + 1]
                start = j + 1
            rest = data[start:]
            if len(rest) > MAX_LINE_BYTES:
                self.abort()
                raise UpstreamProtocolError(f"an event line over {MAX_LINE_BYTES} bytes")
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
        keep = (c.complete and not c.closed and c.error is None and not c.pieces
                and not self._until_close and c.keep_alive)
        if keep:
            c.busy = False
            self._pool.append(c)
        elif c.transport is not None:
            c.transport.close()


UpstreamResponse = Response


def _header_value(v: str) -> str:
    """A header value safe to write: no CR/LF (no header injection); the head is encoded as
    latin-1 with replacement, so it is always encodable."""
    if "\r" in v or "\n" in v:
        return v.replace("\r", " ").replace("\n", " ")
    return v


@dataclass(slots=True)
class _Target:
    host: str
    port: int
    tls: bool
    pool: deque[_Conn]
    head: str  # the request line and Host header


class UpstreamClient:
    def __init__(self) -> None:
        self._pools: dict[tuple[str, str, int, str | None], deque[_Conn]] = {}
        self._targets: dict[tuple[str, str | None], _Target] = {}
        self._tls: dict[str | None, ssl.SSLContext] = {}

    def _context(self, ca_file: str | None) -> ssl.SSLContext:
        ctx = self._tls.get(ca_file)
        if ctx is None:
            ctx = self._tls[ca_file] = ssl.create_default_context(cafile=ca_file)
        return ctx

    def _target(self, url: str, ca_file: str | None) -> _Target:
        """What a URL resolves to (parsed once per URL and CA, then cached)."""
        t = self._targets.get((url, ca_file))
        if t is not None:
            return t
        u = urlsplit(url)
        if u.scheme not in ("http", "https"):
            raise UpstreamConnectError(f"unsupported upstream scheme {u.scheme!r}")
        tls = u.scheme == "https"
        host = u.hostname or "127.0.0.1"
        port = u.port or (443 if tls else 80)
        path = (u.path or "/") + (f"?{u.query}" if u.query else "")
        authority = f"[{host}]" if ":" in host else host
        if u.port is not None:
            authority += f":{port}"
        pool = self._pools.setdefault((u.scheme, host, port, ca_file if tls else None), deque())
        t = _Target(host, port, tls, pool, f"POST {path} HTTP/1.1\r\nHost: {authority}\r\n")
        if len(self._targets) < 4096:
            self._targets[(url, ca_file)] = t
        return t

    async def post(self, url: str, body: bytes, headers: Mapping[str, str], *,
                   connect_timeout_s: float, ca_file: str | None = None) -> Response:
        target = self._target(url, ca_file)
        host, port, tls, pool = target.host, target.port, target.tls, target.pool
        head = "".join([target.head, f"Content-Length: {len(body)}\r\n",
                        *(f"{k}: {_header_value(v)}\r\n" for k, v in headers.items()), "\r\n"])
        payload = head.encode("latin-1", "replace") + body
        while pool:
            conn = pool.pop()
            if conn.closed or conn.transport is None or conn.transport.is_closing():
                continue
            try:
                return await self._exchange(conn, pool, payload)
            except UpstreamBroken:
                if conn.head_bytes:
                    raise  # it had started answering: this one is the upstream's fault
                continue  # a kept-alive connection the upstream had closed: use a fresh one
        loop = asyncio.get_running_loop()
        try:
            _, conn = await asyncio.wait_for(loop.create_connection(
                _Conn, host, port, ssl=self._context(ca_file) if tls else None,
                server_hostname=host if tls else None), connect_timeout_s)
        except TimeoutError:
            raise
        except (OSError, ssl.SSLError) as exc:
            raise UpstreamConnectError(f"could not connect to {host}:{port}: {exc}") from exc
        return await self._exchange(conn, pool, payload)

    async def _exchange(self, conn: _Conn, pool: deque[_Conn], payload: bytes) -> Response:
        """Send a request and read its head; on any failure (including cancellation by a
        timeout) the connection is closed, never leaked nor pooled mid-exchange."""
        try:
            assert conn.transport is not None
            conn._reset()
            conn.busy = True
            conn.transport.write(payload)
            while not conn.head_done:
                await conn.more()
            return Response(conn, pool)
        except BaseException:
            if conn.transport is not None:
                conn.transport.close()
            raise

    async def close(self) -> None:
        """Drop every pooled connection at once (abort: a TLS close would wait for the
        peer's close_notify after the loop that serves it has gone)."""
        for pool in self._pools.values():
            while pool:
                c = pool.pop()
                if c.transport is not None:
                    c.transport.abort()
