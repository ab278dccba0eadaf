"""The limiter's RESP client (``gateway.quota.limiter.redis_client``): its reply parser on every
reply type and every split across reads, and its URLs against real Redis servers: an ACL
user, TLS."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import trustme
from redis_servers import RedisServer, free_port

from gateway.quota.limiter.redis_client import (
    FastRedis,
    NoScript,
    RespError,
    _Conn,
    _Incomplete,
    parse,
)

REPLIES: list[tuple[bytes, object]] = [
    (b":42\r\n", 42),
    (b":-7\r\n", -7),
    (b"$5\r\nhello\r\n", b"hello"),
    (b"$0\r\n\r\n", b""),
    (b"$-1\r\n", None),
    (b"+OK\r\n", b"OK"),
    (b"*-1\r\n", None),
    (b"*0\r\n", []),
    (b"*3\r\n:1\r\n$2\r\nab\r\n*2\r\n+x\r\n$-1\r\n", [1, b"ab", [b"x", None]]),
    (b"$4\r\na\r\nb\r\n", b"a\r\nb"),  # a bulk string may hold CRLF
]


@pytest.mark.parametrize(("wire", "value"), REPLIES)
def test_every_reply_parses_and_no_prefix_of_it_does(wire: bytes, value: object) -> None:
    assert parse(wire, 0) == (value, len(wire))
    assert parse(b"junk" + wire, 4) == (value, len(wire) + 4)
    for cut in range(len(wire)):
        with pytest.raises(_Incomplete):
            parse(wire[:cut], 0)


def test_error_replies_become_exceptions() -> None:
    err, end = parse(b"-ERR wrong number of arguments\r\n", 0)
    assert isinstance(err, RespError) and "wrong number" in str(err) and end == 32
    nos, _ = parse(b"-NOSCRIPT No matching script\r\n", 0)
    assert isinstance(nos, NoScript)


async def test_replies_split_across_reads_reach_their_callers_in_order() -> None:
    wire = b"".join(w for w, _ in REPLIES)
    values = [v for _, v in REPLIES]
    loop = asyncio.get_running_loop()
    for step in (1, 2, 3, 7, 13, len(wire)):
        conn = _Conn()
        futs = [loop.create_future() for _ in values]
        conn.pending.extend(futs)
        for i in range(0, len(wire), step):
            conn.data_received(wire[i:i + step])
        assert [f.result() for f in futs] == values, step
        assert not conn.buf  # nothing left over, nothing copied into the buffer for nothing


async def test_a_reply_that_is_not_resp_drops_the_connection() -> None:
    conn = _Conn()
    fut = asyncio.get_running_loop().create_future()
    conn.pending.append(fut)
    conn.data_received(b"HTTP/1.1 400 Bad Request\r\n\r\n")
    with pytest.raises(ConnectionError):
        fut.result()
    assert conn.closed


def test_unknown_schemes_and_bad_databases_are_refused() -> None:
    for url in ("http://127.0.0.1:6379", "unix:///tmp/redis.sock", "redis://h:1/zero"):
        with pytest.raises(ValueError):
            FastRedis(url)


async def test_commands_asked_together_share_one_connection_and_write(tmp_path: Path
                                                                        ) -> None:
    """A request's quota and tier reservations are asked in one loop iteration: they leave in
    one write on one connection (one round trip); commands asked later spread over the
    connections as before."""
    server = RedisServer(tmp_path / "join")
    r = FastRedis(server.url, connections=2)
    try:
        await asyncio.gather(r.execute("PING"), r.execute("PING"))  # both connections open
        together = await asyncio.gather(*(r.execute("CLIENT", "ID") for _ in range(4)))
        assert len(set(together)) == 1
        apart = {await r.execute("CLIENT", "ID") for _ in range(4)}
        assert len(apart) == 2
    finally:
        await r.aclose()
        server.stop()


async def test_an_acl_user_authenticates_with_its_username(tmp_path: Path) -> None:
    server = RedisServer(tmp_path / "acl")
    try:
        admin = FastRedis(server.url)
        await admin.execute("ACL", "SETUSER", "alice", "on", ">s3cret", "~*", "+@all")
        await admin.aclose()
        good = FastRedis(f"redis://alice:s3cret@127.0.0.1:{server.port}/0")
        assert await good.execute("PING") == b"PONG"
        assert await good.execute("ACL", "WHOAMI") == b"alice"
        await good.aclose()
        bad = FastRedis(f"redis://alice:wrong@127.0.0.1:{server.port}/0")
        with pytest.raises(RespError, match="WRONGPASS"):
            await bad.execute("PING")
        await bad.aclose()
    finally:
        server.stop()


async def test_rediss_speaks_tls_and_verifies_the_server(tmp_path: Path) -> None:
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    files = {n: tmp_path / f"{n}.pem" for n in ("ca", "cert", "key")}
    ca.cert_pem.write_to_path(str(files["ca"]))
    cert.cert_chain_pems[0].write_to_path(str(files["cert"]))
    cert.private_key_pem.write_to_path(str(files["key"]))
    tls_port = free_port()
    server = RedisServer(tmp_path / "tls", None, "--tls-port", str(tls_port),
                         "--tls-cert-file", str(files["cert"]), "--tls-key-file",
                         str(files["key"]), "--tls-ca-cert-file", str(files["ca"]),
                         "--tls-auth-clients", "no")
    try:
        client = FastRedis(f"rediss://127.0.0.1:{tls_port}/0?ssl_ca_certs={files['ca']}")
        assert await client.execute("PING") == b"PONG"
        await client.aclose()
        # The system's CAs do not know this server: refused, not downgraded to plaintext.
        unverified = FastRedis(f"rediss://127.0.0.1:{tls_port}/0", timeout_s=2)
        with pytest.raises(OSError):
            await unverified.execute("PING")
        await unverified.aclose()
        # And plaintext to the TLS port gets no answer it could take for Redis's.
        plain = FastRedis(f"redis://127.0.0.1:{tls_port}/0", timeout_s=1)
        with pytest.raises((ConnectionError, TimeoutError)):
            await plain.execute("PING")
        await plain.aclose()
    finally:
        server.stop()
