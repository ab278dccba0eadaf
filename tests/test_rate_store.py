"""The RateStore contract, one suite over the in-memory store, a real Redis and a real
3-master Redis Cluster (both started by the tests)."""

from __future__ import annotations

import asyncio
import itertools
import math
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from redis_servers import RedisCluster, RedisServer

from gateway.quota.limiter.bucket import Limit, spend_cap
from gateway.quota.limiter.memory import MemoryStore
from gateway.quota.limiter.redis_store import RedisStore
from gateway.quota.limiter.store import Charge, RateStore, Reservation, Settlement

HOUR = 3600.0  # slow refill: a test's own duration adds well under one token of credit
_ids = itertools.count()


def tokens(amount: float, burst: float | None = None) -> Limit:
    return Limit("tokens", amount, HOUR, burst or amount)


def requests(amount: float) -> Limit:
    return Limit("requests", amount, HOUR, amount)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    s = RedisServer(tmp_path_factory.mktemp("redis"))
    yield s
    s.stop()


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisCluster]:
    c = RedisCluster(tmp_path_factory.mktemp("cluster"))
    yield c
    c.stop()


@pytest.fixture(params=["memory", "redis", "cluster"])
async def store(request: pytest.FixtureRequest) -> AsyncIterator[RateStore]:
    s: RateStore
    if request.param == "memory":
        s = MemoryStore()
    elif request.param == "redis":
        s = RedisStore.from_url(request.getfixturevalue("redis_server").url)
    else:
        s = RedisStore.from_url(request.getfixturevalue("redis_cluster").url)
    yield s
    await s.close()


def scope(name: str) -> str:
    """A fresh scope name per test (Redis state outlives one test)."""
    return f"{name}-{next(_ids)}"


async def test_reserve_is_all_or_nothing_across_scopes(store: RateStore) -> None:
    a, b = scope("tenant:a"), scope("model:m")
    ok = await store.reserve([Charge(a, tokens(1000), 100), Charge(b, tokens(150), 100)], "r1")
    assert ok.allowed and ok.reservation is not None
    no = await store.reserve([Charge(a, tokens(1000), 100), Charge(b, tokens(150), 100)], "r2")
    assert not no.allowed and no.reservation is None
    assert no.denied is not None and no.denied.scope == b
    assert no.denied.requested == 100 and no.denied.limit.amount == 150
    assert no.denied.used == pytest.approx(100, abs=1)
    # Scope a was not charged by the refused request: 900 tokens are still there.
    assert (await store.reserve([Charge(a, tokens(1000), 900)], "r3")).allowed
    assert not (await store.reserve([Charge(a, tokens(1000), 5)], "r4")).allowed


async def test_denial_says_when_to_retry(store: RateStore) -> None:
    s = scope("tenant:t")
    per_minute = Limit("tokens", 600, 60.0, 600)  # 10 tokens/s
    assert (await store.reserve([Charge(s, per_minute, 600)], "a")).allowed
    no = await store.reserve([Charge(s, per_minute, 50)], "b")
    assert not no.allowed and no.denied is not None
    assert no.denied.retry_after_s == pytest.approx(5.0, abs=0.3)
    huge = await store.reserve([Charge(scope("tenant:u"), per_minute, 601)], "c")
    assert not huge.allowed and huge.denied is not None and math.isinf(huge.denied.retry_after_s)


async def test_states_report_remaining_and_reset(store: RateStore) -> None:
    s = scope("tenant:h")
    d = await store.reserve([Charge(s, requests(10), 1), Charge(s, tokens(1000), 250)], "x")
    req, tok = d.states
    assert req.remaining == pytest.approx(9, abs=0.01) and tok.remaining == pytest.approx(750,
                                                                                          abs=1)
    assert tok.reset_s == pytest.approx(250 * HOUR / 1000, rel=0.01)


async def test_peek_reads_the_buckets_and_charges_nothing(store: RateStore) -> None:
    s, other = scope("tenant:p"), scope("model:p")
    assert (await store.reserve([Charge(s, tokens(1000), 300)], "p1")).allowed
    for _ in range(2):  # looking twice changes nothing
        used, fresh = await store.peek([Charge(s, tokens(1000), 0), Charge(other, tokens(50), 0)])
        assert used.remaining == pytest.approx(700, abs=1) and used.scope == s
        assert used.reset_s == pytest.approx(300 * HOUR / 1000, rel=0.01)
        assert fresh.remaining == 50 and fresh.reset_s == 0


async def test_lift_raises_a_bucket_to_what_a_ledger_says_never_lowers_it(
        store: RateStore) -> None:
    """A spend cap's bucket is lifted to what was spent (a rebuild after a restart): a lift
    below what is in use changes nothing, a second lift to the same changes nothing, and a
    new cap (a reload) reads the same spend."""
    cap, s = spend_cap("budget_monthly", 10.0), scope("tenant:lift")
    c = Charge(s, cap, 2.0)
    assert (await store.reserve([c], scope("lift"))).allowed  # $2 in use
    assert await store.lift([Charge(s, cap, 1.5)]) == 0
    assert await store.lift([Charge(s, cap, 3.25)]) == 1
    await asyncio.sleep(0.05)  # time passes: the cap "refilled" by 5e-15 of a dollar
    assert await store.lift([Charge(s, cap, 3.25)]) == 0
    (st,) = await store.peek([c])
    assert st.used == pytest.approx(3.25)
    (raised,) = await store.peek([Charge(s, spend_cap("budget_monthly", 50.0), 0.0)])
    assert raised.used == pytest.approx(3.25) and raised.remaining == pytest.approx(46.75)


async def test_settlement_refunds_unused_and_charges_overrun_once(store: RateStore) -> None:
    s = scope("tenant:s")
    lim = tokens(1000)
    d = await store.reserve([Charge(s, lim, 600)], "res-1")
    assert d.reservation is not None
    st = Settlement(d.reservation)
    deltas = st.deltas_to({"tokens": 200})  # used 200 of the 600 reserved
    assert deltas == {(s, "tokens"): -400}
    assert await store.adjust(d.reservation, deltas, "final")
    assert not await store.adjust(d.reservation, deltas, "final")  # a retry changes nothing
    st.record(deltas)
    assert (await store.reserve([Charge(s, lim, 800)], "res-2")).allowed  # 200 + 800 = 1000
    assert not (await store.reserve([Charge(s, lim, 5)], "res-3")).allowed
    # An overrun is charged even past the limit, and then blocks the scope.
    t = scope("tenant:o")
    d2 = await store.reserve([Charge(t, lim, 100)], "res-4")
    assert d2.reservation is not None
    assert await store.adjust(d2.reservation, {(t, "tokens"): 950}, "final")
    no = await store.reserve([Charge(t, lim, 1)], "res-5")
    assert not no.allowed and no.denied is not None and no.denied.retry_after_s > 100


async def test_failure_before_first_token_refunds_everything(store: RateStore) -> None:
    s = scope("tenant:f")
    charges = [Charge(s, requests(1), 1), Charge(s, tokens(100), 100)]
    d = await store.reserve(charges, "fail-1")
    assert d.reservation is not None
    st = Settlement(d.reservation)
    await store.adjust(d.reservation, st.deltas_to({"requests": 0, "tokens": 0}), "final")
    assert (await store.reserve(charges, "fail-2")).allowed


async def test_progressive_charges_are_idempotent_per_step(store: RateStore) -> None:
    s = scope("tenant:p")
    lim = tokens(1000)
    d = await store.reserve([Charge(s, lim, 100)], "long")
    assert d.reservation is not None
    for step in ("p1", "p2", "p1", "p2"):
        await store.adjust(d.reservation, {(s, "tokens"): 200}, step)
    assert (await store.reserve([Charge(s, lim, 500)], "other")).allowed  # 100+200+200+500
    assert not (await store.reserve([Charge(s, lim, 5)], "again")).allowed


async def test_concurrent_reservations_never_over_admit(store: RateStore) -> None:
    a, b = scope("tenant:c"), scope("model:c")
    charges = [Charge(a, tokens(1000), 10), Charge(b, tokens(5000), 10),
               Charge(a, requests(10_000), 1)]
    results = await asyncio.gather(*(store.reserve(charges, f"c{i}") for i in range(300)))
    assert sum(r.allowed for r in results) == 100


async def test_optional_charges_ride_the_reservation_and_never_refuse(store: RateStore
                                                                       ) -> None:
    """A tier bucket as an optional charge: taken with the request while it has room (then
    settled with it, like any charge of the reservation), left untouched when it has not,
    never the reason for a refusal, and never taken by a refused request."""
    quota, tier = scope("tenant:q"), scope("reserved:q|model:m")
    q, t = tokens(10_000), tokens(150)
    d = await store.reserve([Charge(quota, q, 100)], "o1", optional=[Charge(tier, t, 100)])
    assert d.allowed and d.optional and d.reservation is not None
    assert {c.scope for c in d.reservation.charges} == {quota, tier}
    assert [s.scope for s in d.states] == [quota]  # headers: the quota's buckets only
    no = await store.reserve([Charge(quota, q, 100)], "o2", optional=[Charge(tier, t, 100)])
    assert no.allowed and not no.optional  # 50 left of the tier: payg, admitted all the same
    assert no.reservation is not None and [c.scope for c in no.reservation.charges] == [quota]
    # settled with the request: 40 served of the 100 reserved, 60 back to the tier bucket
    st = Settlement(d.reservation)
    assert await store.adjust(d.reservation, st.deltas_to({"tokens": 40}), "final")
    ok = await store.reserve([Charge(quota, q, 100)], "o3", optional=[Charge(tier, t, 100)])
    assert ok.optional  # 150 - 40 = 110 left
    (left,) = await store.peek([Charge(tier, t, 0)])
    assert 9 <= left.remaining <= 11
    # a refused request takes nothing, optional or not
    full = await store.reserve([Charge(quota, q, 20_000)], "o4", optional=[Charge(tier, t, 5)])
    assert not full.allowed and not full.optional
    assert full.denied is not None and full.denied.scope == quota
    (after,) = await store.peek([Charge(tier, t, 0)])
    assert after.remaining == pytest.approx(left.remaining, abs=0.5)
    # optional charges alone (no limit on the request's own scopes)
    alone = scope("reserved:z|model:m")
    solo = await store.reserve([], "o5", optional=[Charge(alone, t, 100)])
    assert solo.allowed and solo.optional


async def test_concurrent_optional_charges_never_over_take(store: RateStore) -> None:
    quota, tier = scope("tenant:cq"), scope("reserved:cq|model:m")
    results = await asyncio.gather(*(
        store.reserve([Charge(quota, tokens(100_000), 10)], f"co{i}",
                      optional=[Charge(tier, tokens(500), 10)]) for i in range(120)))
    assert all(r.allowed for r in results)
    assert sum(r.optional for r in results) == 50


async def test_a_lost_answer_voids_optional_charges_only_if_they_were_taken(
        redis_server: RedisServer) -> None:
    """The void of a reservation whose answer was lost gives back its optional charges only
    when the script took them (it cannot know from the caller's side)."""
    st = RedisStore.from_url(redis_server.url)
    try:
        quota, tier = scope("tenant:v"), scope("reserved:v|model:m")
        q, t = Charge(quota, tokens(1000), 100), Charge(tier, tokens(150), 100)
        assert (await st.reserve([q], "v1", optional=[t])).optional
        assert await st.void(Reservation("v1", (q, t), optional=1)) == 1
        left = await st.peek([Charge(quota, tokens(1000), 0), Charge(tier, tokens(150), 0)])
        assert [round(b.remaining) for b in left] == [1000, 150]  # both back
        assert (await st.reserve([], "fill", optional=[Charge(tier, tokens(150), 120)])
                ).optional
        assert not (await st.reserve([q], "v2", optional=[t])).optional  # 30 left: not taken
        assert await st.void(Reservation("v2", (q, t), optional=1)) == 1
        left = await st.peek([Charge(quota, tokens(1000), 0), Charge(tier, tokens(150), 0)])
        assert [round(b.remaining) for b in left] == [1000, 30]  # the tier as it was
    finally:
        await st.close()


async def test_rollback_of_partial_reservations_on_a_cluster(redis_cluster: RedisCluster) -> None:
    st = RedisStore.from_url(redis_cluster.url)
    try:
        a, b = scope("tenant:x"), scope("route:y")  # different slots (different hash tags)
        assert (await st.reserve([Charge(b, tokens(100), 100)], "fill")).allowed
        no = await st.reserve([Charge(a, tokens(100), 60), Charge(b, tokens(100), 10)], "p")
        assert not no.allowed
        # a's 60 were reserved first, then refunded: 100 are available again.
        assert (await st.reserve([Charge(a, tokens(100), 100)], "q")).allowed
    finally:
        await st.close()


def test_lua_scripts_ship_as_package_data() -> None:
    import gateway.quota.limiter

    lua = Path(gateway.quota.limiter.__file__).parent / "lua"
    assert {p.name for p in lua.glob("*.lua")} == {"reserve.lua", "adjust.lua", "void.lua",
                                                "peek.lua", "lift.lua"}


def test_redis_store_under_uvloop(redis_server: RedisServer) -> None:
    """The CLI runs on uvloop, whose transports differ from asyncio's: exercise that path."""
    import uvloop

    async def main() -> tuple[bool, bool]:
        st = RedisStore.from_url(redis_server.url)
        try:
            s = scope("tenant:uv")
            d = await st.reserve([Charge(s, tokens(100), 60)], "uv1")
            assert d.reservation is not None
            await st.adjust(d.reservation, {(s, "tokens"): -60}, "final")
            again = await st.reserve([Charge(s, tokens(100), 100)], "uv2")
            return d.allowed, again.allowed
        finally:
            await st.close()

    assert uvloop.run(main()) == (True, True)


async def test_a_silent_redis_times_out_as_unavailable() -> None:
    """A server that accepts but never answers: the store gives up within its timeout."""
    from gateway.quota.limiter.store import StoreUnavailable

    done = asyncio.Event()
    writers: list[asyncio.StreamWriter] = []

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers.append(writer)
        await reader.read(1 << 16)
        await done.wait()

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    st = RedisStore.from_url(f"redis://127.0.0.1:{port}/0", socket_timeout=0.2)
    try:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        with pytest.raises(StoreUnavailable):
            await st.reserve([Charge("tenant:silent", tokens(10), 1)], "s1")
        assert loop.time() - t0 < 1.0
    finally:
        await st.close()
        done.set()
        for w in writers:
            w.close()
            await w.wait_closed()
        server.close()
        await server.wait_closed()


async def test_a_cluster_with_no_reachable_node_is_unavailable() -> None:
    """Re-discovering a cluster whose nodes all refuse raises redis-py's
    RedisClusterException (not a RedisError): the store reports it as unavailable, so the
    gateway fails open or closed as its policy says instead of answering 500."""
    import socket

    from gateway.quota.limiter.store import StoreUnavailable

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    st = RedisStore.from_url(f"redis+cluster://127.0.0.1:{port}", socket_connect_timeout=0.2)
    try:
        with pytest.raises(StoreUnavailable):
            await st.reserve([Charge("tenant:gone", tokens(10), 1)], "c1")
    finally:
        await st.close()


async def test_memory_store_forgets_marks_after_their_reservation_life() -> None:
    """Marks expire with their reservation's life, one heap pop each (not a scan of every
    mark per settlement): a step retried within the life applies once; the marks held stay
    bounded by the settlement rate times the life."""
    from gateway.quota.limiter.memory import MemoryStore

    now = [1000.0]
    store = MemoryStore(clock=lambda: now[0])
    lim = tokens(1e12)
    first = await store.reserve([Charge("tenant:m", lim, 10)], "r0", life_s=30)
    assert first.reservation is not None
    assert await store.adjust(first.reservation, {("tenant:m", "tokens"): -1}, "final")
    now[0] += 29
    assert not await store.adjust(first.reservation, {("tenant:m", "tokens"): -1}, "final")
    held = []
    for i in range(20_000):  # one settlement every 10 ms for 200 s
        now[0] += 0.01
        d = await store.reserve([Charge("tenant:m", lim, 10)], f"r{i + 1}", life_s=30)
        assert d.reservation is not None
        await store.adjust(d.reservation, {("tenant:m", "tokens"): -1}, "final")
        held.append(len(store._applied))
    assert max(held) <= 30 / 0.01 + 2
    assert len(store._applied) == len(store._expiry)
