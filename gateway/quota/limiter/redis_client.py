"""A lean, pipelined RESP2 client for the limiter's hot path (standalone Redis).

The limiter sends two small script calls per request. With redis-py's asyncio client those
cost ~0.2 ms of Python each (connection pool, retry wrapper, RESP3 parser), which made the
Redis limiter most of the gateway's CPU. This client keeps a few connections open, writes each
command straight to a socket and matches replies to callers in order (Redis answers a
connection's commands in order), so many requests share a connection without waiting for each
other. It speaks only what the limiter needs: commands in, integers, bulk strings, arrays and
errors out. Redis Cluster still goes through redis-py (slot routing, redirections).

URLs: ``redis://[[user]:password@]host[:port][/db]`` and ``rediss://…`` (TLS, verified against
the system's CAs or ``?ssl_ca_certs=FILE``; ``?ssl_cert_reqs=none`` turns verification off).
A username is sent as an ACL ``AUTH user password``. Any other scheme is refused.
"""

from __future__ import annotations

import asyncio
import itertools
import ssl
from collections import deque
from typing import Any, cast
from urllib.parse import parse_qs, unquote, urlsplit


class RespError(Exception):
    """An error reply from Redis (``-ERR ...``)."""


class NoScript(RespError):
    """``-NOSCRIPT``: the server does not have the script (restarted or failed over)."""


class _Incomplete(Exception):
    pass


def encode(args: tuple[Any, ...]) -> bytes:
    parts = [a if isinstance(a, bytes) else str(a).encode() for a in args]
    return b"*%d\r\n" % len(parts) + b"".join(
        b"$%d\r\n%s\r\n" % (len(b), b) for b in parts)


def parse(buf: bytes | bytearray, pos: int) -> tuple[Any, int]:
    """One reply starting at ``pos``; raises _Incomplete when the buffer ends first."""
    end = buf.find(b"\r\n", pos)
    if end < 0:
        raise _Incomplete
    kind, line = buf[pos:pos + 1], buf[pos + 1:end]
    pos = end + 2
    if kind == b":":
        return int(line), pos
    if kind == b"$":
        n = int(line)
        if n < 0:
            return None, pos
        if len(buf) < pos + n + 2:
            raise _Incomplete
        return bytes(buf[pos:pos + n]), pos + n + 2
    if kind == b"+":
        return bytes(line), pos
    if kind == b"-":
        msg = bytes(line).decode(errors="replace")
        return (NoScript(msg) if msg.startswith("NOSCRIPT") else RespError(msg)), pos
    if kind == b"*":
        n = int(line)
        if n < 0:
            return None, pos
        items = []
        for _ in range(n):
            item, pos = parse(buf, pos)
            items.append(item)
        return items, pos
    raise RespError(f"unexpected reply type {kind!r}")


class _Conn(asyncio.Protocol):
    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.pending: deque[asyncio.Future[Any]] = deque()
        self.buf = bytearray()  # received, not yet parsed: appended to, its head consumed
        self.closed = False
        self.out: list[bytes] = []  # commands queued, not yet written
        self._soon = False  # a write at the end of this loop iteration is scheduled
        self._later: asyncio.TimerHandle | None = None  # a deferred write is scheduled

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # NOTE: uvloop's transports are not asyncio.Transport subclasses; do not check the type.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        if self.buf:
            self.buf += data
            buf: bytes | bytearray = self.buf
        else:
            buf = data  # the common case, a reply in one read: parsed in place, no copy
        pos = 0
        try:
            while self.pending and pos < len(buf):
                reply, pos = parse(buf, pos)
                fut = self.pending.popleft()
                if not fut.done():
                    if isinstance(reply, RespError):
                        fut.set_exception(reply)
                    else:
                        fut.set_result(reply)
        except _Incomplete:
            pass
        except (ValueError, RespError) as exc:  # not RESP: the connection cannot be trusted
            if self.transport is not None:
                self.transport.abort()
            self.connection_lost(exc)
            return
        if buf is self.buf:
            del self.buf[:pos]
        elif pos < len(data):
            self.buf += data[pos:]

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        err = ConnectionError(f"redis connection lost: {exc}")
        while self.pending:
            fut = self.pending.popleft()
            if not fut.done():
                fut.set_exception(err)

    def send(self, args: tuple[Any, ...], defer: bool = False) -> asyncio.Future[Any]:
        """Queue a command. Every command queued in one event-loop iteration leaves in one
        socket write (a write to loopback costs a system call and wakes Redis, so under load
        the requests' reservations and settlements share them). With ``defer`` the command
        waits up to ``DEFER_S`` for another one to travel with (a refund rides with the next
        request's reservation instead of waking Redis on its own)."""
        assert self.transport is not None
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()
        self.pending.append(fut)
        self.out.append(encode(args))
        if not defer:
            if not self._soon:
                self._soon = True
                loop.call_soon(self._flush)
        elif self._later is None and not self._soon:
            self._later = loop.call_later(DEFER_S, self._flush)
        return fut

    def _flush(self) -> None:
        self._soon = False
        if self._later is not None:
            self._later.cancel()
            self._later = None
        if not self.out:
            return
        data, self.out = b"".join(self.out), []
        if self.transport is not None and not self.closed:
            self.transport.write(data)


DEFER_S = 0.05  # how long a deferred command may wait for company


def _expire(fut: asyncio.Future[Any], conn: _Conn) -> None:
    """A reply is overdue: fail the caller and drop the connection, since a late reply would
    otherwise be matched to the wrong caller."""
    if not fut.done():
        fut.set_exception(TimeoutError("redis did not answer in time"))
        if conn.transport is not None:
            conn.transport.abort()


def tls_context(query: str) -> ssl.SSLContext:
    """The TLS context of a ``rediss://`` URL's query (redis-py's parameter names)."""
    q = parse_qs(query)
    cas = q.get("ssl_ca_certs")
    ctx = ssl.create_default_context(cafile=cas[0] if cas else None)
    if (q.get("ssl_cert_reqs") or ["required"])[0].lower() == "none":
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    return ctx


class FastRedis:
    """``redis://`` or ``rediss://`` (TLS) ``[user:password@]host:port/db`` over
    ``connections`` pipelined sockets."""

    def __init__(self, url: str, *, connections: int = 2, timeout_s: float = 1.0) -> None:
        u = urlsplit(url)
        if u.scheme not in ("redis", "rediss"):
            raise ValueError(f"unsupported Redis URL scheme {u.scheme!r} (redis:// or "
                             "rediss://; redis+cluster:// for a cluster)")
        self.host = u.hostname or "127.0.0.1"
        self.port = u.port or 6379
        try:
            self.db = int((u.path or "/0").lstrip("/") or 0)
        except ValueError:
            raise ValueError(f"the Redis URL's database must be a number, got {u.path!r}"
                             ) from None
        self.username = unquote(u.username) if u.username else None
        self.password = unquote(u.password) if u.password is not None else None
        self.tls = tls_context(u.query) if u.scheme == "rediss" else None
        self.timeout_s = timeout_s
        self._conns: list[_Conn | None] = [None] * connections
        self._locks = [asyncio.Lock() for _ in range(connections)]
        self._next = itertools.cycle(range(connections))
        self._joinable: _Conn | None = None  # the connection with a write due this iteration

    async def _conn(self, i: int) -> _Conn:
        c = self._conns[i]
        if c is not None and not c.closed:
            return c
        async with self._locks[i]:
            c = self._conns[i]
            if c is not None and not c.closed:
                return c
            loop = asyncio.get_running_loop()
            _, proto = await asyncio.wait_for(
                loop.create_connection(_Conn, self.host, self.port, ssl=self.tls,
                                       server_hostname=self.host if self.tls else None),
                self.timeout_s)
            if self.password is not None:
                auth = (("AUTH", self.username, self.password) if self.username else
                        ("AUTH", self.password))
                await asyncio.wait_for(proto.send(auth), self.timeout_s)
            if self.db:
                await asyncio.wait_for(proto.send(("SELECT", self.db)), self.timeout_s)
            self._conns[i] = proto
            return proto

    async def execute(self, *args: Any, defer: bool = False) -> Any:
        conn = self._joinable
        if conn is None or not conn._soon or conn.closed:
            # commands issued in one loop iteration share a write (and Redis's reply): a
            # request's quota and tier reservations, asked together, cost one round trip
            i = next(self._next)
            conn = self._conns[i]
            if conn is None or conn.closed:
                conn = await self._conn(i)
        fut = conn.send(args, defer)
        if conn._soon:
            self._joinable = conn
        # A timer instead of asyncio.wait_for: no extra task per call on the hot path.
        timer = asyncio.get_running_loop().call_later(self.timeout_s, _expire, fut, conn)
        try:
            return await fut
        finally:
            timer.cancel()

    async def script_load(self, src: str) -> str:
        sha = await self.execute("SCRIPT", "LOAD", src)
        return sha.decode() if isinstance(sha, bytes) else str(sha)

    async def evalsha(self, sha: str, numkeys: int, *args: Any, defer: bool = False) -> Any:
        return await self.execute("EVALSHA", sha, numkeys, *args, defer=defer)

    async def eval(self, src: str, numkeys: int, *args: Any) -> Any:
        return await self.execute("EVAL", src, numkeys, *args)

    async def aclose(self) -> None:
        for c in self._conns:
            if c is not None and c.transport is not None:
                c.transport.close()
        self._conns = [None] * len(self._conns)
