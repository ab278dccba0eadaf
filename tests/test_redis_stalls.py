"""The ledger holds through Redis stalls (a real redis-server, stopped with SIGSTOP and resumed):
a reservation whose answer was lost is voided by id, exactly once, whether its command ran
(on resume) or not; a settlement step lost in a stall is applied once when Redis is back; a
fallback admitted while Redis is away is a 503 ``limiter_unavailable`` (fail_closed), and the
primary's reservation still goes back."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis
from gateway_stack import start_gateway, write_policy
from ledger import sha
from raw_upstream import Answer, RawUpstream, Request, json_response
from redis_servers import RedisServer

from gateway.quota.limiter.bucket import Limit
from gateway.quota.limiter.redis_store import RedisStore
from gateway.quota.limiter.resilient import ResilientStore
from gateway.quota.limiter.store import Charge, Reservation, Settlement, StoreUnavailable

HOUR = 3600.0


@pytest.fixture
def server(tmp_path: Path) -> Iterator[RedisServer]:
    s = RedisServer(tmp_path / "redis")
    yield s
    resume(s)
    s.stop()


def pause(s: RedisServer) -> None:
    assert s.proc is not None
    os.kill(s.proc.pid, signal.SIGSTOP)


def resume(s: RedisServer) -> None:
    if s.proc is not None:
        os.kill(s.proc.pid, signal.SIGCONT)


def tokens(n: float) -> Limit:
    return Limit("tokens", n, HOUR, n)


async def settled(st: RedisStore, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while st.owed and time.monotonic() < deadline:  # noqa: ASYNC110 - the store's own task
        await asyncio.sleep(0.02)
    assert not st.owed


async def whole(st: RedisStore, scope: str, n: float) -> bool:
    """Whether the bucket still has its whole burst (nothing is held on it): a reservation
    of all of it is admitted (and given back)."""
    r = await st.reserve([Charge(scope, tokens(n), n)], f"probe{time.monotonic_ns()}")
    if r.allowed:
        assert r.reservation is not None
        await st.void(r.reservation)
    return r.allowed


def test_a_reservation_whose_answer_was_lost_is_given_back(server: RedisServer) -> None:
    async def main() -> None:
        st = RedisStore.from_url(server.url, socket_timeout=0.3)
        try:
            assert await whole(st, "tenant:warm", 10)  # scripts loaded, connection open
            charge = [Charge("tenant:a", tokens(10_000), 1508)]
            pause(server)
            with pytest.raises(StoreUnavailable):
                await st.reserve(charge, "lost")
            assert st.stats.owed == 1
            await asyncio.sleep(0.2)
            resume(server)  # the reservation on the wire runs now, then the void
            await settled(st)
            assert st.stats.compensated == 1
            assert await whole(st, "tenant:a", 10_000)
        finally:
            await st.close()

    asyncio.run(main())


def test_a_void_that_arrives_first_stops_the_reservation_and_counts_once(
        server: RedisServer) -> None:
    async def main() -> None:
        st = RedisStore.from_url(server.url)
        try:
            charge = (Charge("tenant:b", tokens(100), 60),)
            assert await st.void(Reservation("early", charge, 60)) == 2  # had not run
            late = await st.reserve(charge, "early")  # the command that was on the wire
            assert not late.allowed
            assert await whole(st, "tenant:b", 100)
            assert await st.void(Reservation("early", charge, 60)) == 0  # once
            ran = await st.reserve(charge, "ran")
            assert ran.allowed
            assert await st.void(Reservation("ran", charge, 60)) == 1
            assert await st.void(Reservation("ran", charge, 60)) == 0
            assert await whole(st, "tenant:b", 100)
        finally:
            await st.close()

    asyncio.run(main())


def test_a_settlement_step_lost_in_a_stall_is_applied_once(server: RedisServer) -> None:
    async def main() -> None:
        st = RedisStore.from_url(server.url, socket_timeout=0.3)
        try:
            d = await st.reserve([Charge("tenant:c", tokens(1000), 1000)], "r1")
            assert d.allowed and d.reservation is not None
            pause(server)
            # The refund of everything: owed, counted as done (it will be).
            assert await st.adjust(d.reservation, {("tenant:c", "tokens"): -1000.0}, "final")
            assert st.stats.owed == 1
            resume(server)
            await settled(st)
            assert not await st.adjust(d.reservation, {("tenant:c", "tokens"): -1000.0},
                                       "final")  # already applied: not twice
            assert await whole(st, "tenant:c", 1000)
        finally:
            await st.close()

    asyncio.run(main())


TPD = 1000.0  # tokens a day: 86.4 s of the bucket per token, so a test's seconds refill ~0


def held(port: int, key: str) -> float:
    """Tokens the tenant's daily bucket holds, read from Redis at its own clock."""
    r = redis.Redis(port=port)
    tat = float(r.hget(key, "tokens_day") or 0.0)
    sec, usec = r.time()
    return max(0.0, tat - (sec + usec / 1e6)) / (86400.0 / TPD)


def test_a_local_settlement_during_an_outage_counts_at_the_replicas_share_once(
        server: RedisServer) -> None:
    """Redis away, two replicas counted, ``fail_open``: a reservation made by the local
    limiter (half the limit) is settled there with the deltas the request's settlement
    computes from it, once: 400 reserved of 500, 300 served, 200 left (not 300: the
    reservation's charges were scaled to the share a second time, doubling every delta)."""
    async def main() -> None:
        st = ResilientStore(RedisStore.from_url(server.url), replicas=2)
        server.stop()
        try:
            d = await st.reserve([Charge("tenant:o", tokens(1000), 400)], "out")
            assert d.allowed and d.reservation is not None and d.states[0].remaining == 100
            s = Settlement(d.reservation)
            assert await st.adjust(d.reservation, s.deltas_to({"tokens": 300}), "final")
            (left,) = await st.local.peek([Charge("tenant:o", tokens(500), 0)])
            assert left.remaining == pytest.approx(200, abs=0.5)
        finally:
            await st.close()
    asyncio.run(main())


@pytest.mark.parametrize("stream", [False, True])
def test_failover_while_redis_is_away_is_a_503_and_the_primary_is_refunded(
        server: RedisServer, tmp_path: Path, stream: bool) -> None:
    """fail_closed; the primary answers 503 after 1.5 s, Redis stops 0.3 s in: the fallback's
    admission cannot reach Redis."""
    def slow_503(req: Request) -> Answer:
        return [1.5, json_response(503, {"error": {"message": "busy"}})]

    primary, fallback = RawUpstream(slow_503).start(), RawUpstream(slow_503).start()
    # every request reserved in Redis (no lease: the refund is read there)
    doc = {"version": 1,
           "settings": {"redis_failure": "fail_closed", "retries": {"max_attempts": 1},
                        "quota_lease": 0},
           "models": {"m": {"endpoints": [{"url": primary.url}], "upstream_model": "up",
                            "fallback": ["f"], "default_max_tokens": 16},
                      "f": {"endpoints": [{"url": fallback.url}], "upstream_model": "up",
                            "default_max_tokens": 16}},
           "tenants": {"t": {"keys": [{"sha256": sha("k")}], "limits": {"tpd": TPD}}},
           "routes": {"r": {"tenants": ["t"], "models": ["m", "f"]}}}
    gw = start_gateway(write_policy(tmp_path / "p.yaml", doc), redis_url=server.url)
    try:
        timer = threading.Timer(0.3, pause, (server,))
        timer.start()
        r = httpx.post(f"{gw.url}/v1/completions", headers={"Authorization": "Bearer k"},
                       json={"model": "m", "prompt": "hi", "stream": stream}, timeout=20)
        timer.join()
        assert r.status_code == 503, r.text
        assert r.json() == {"error": {"message": "rate limiting is unavailable",
                                      "type": "service_unavailable", "param": None,
                                      "code": "limiter_unavailable"}}
        assert not fallback.requests  # nothing sent without a reservation
        resume(server)
        store = gw.state.store
        assert isinstance(store, ResilientStore) and isinstance(store.primary, RedisStore)
        shared = store.primary
        deadline = time.monotonic() + 10
        while (shared.owed or gw.state.background) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert held(server.port, "tg:{tenant:t}") < 0.5  # the primary's 18 tokens came back
    finally:
        resume(server)
        gw.close()
        primary.close()
        fallback.close()
