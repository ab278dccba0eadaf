"""Quota leases (``gateway.quota.limiter.lease``) on a real Redis: replicas admit from leased
slices without a round trip per request, never above the bucket, under it by at most what
they hold, settle locally exactly once, give back what they do not use, keep small limits
per request, and leave outages to ``ResilientStore``."""

from __future__ import annotations

import asyncio
import itertools
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from redis_servers import RedisServer

from gateway.quota.limiter.bucket import Limit
from gateway.quota.limiter.lease import LeasedStore
from gateway.quota.limiter.redis_store import RedisStore
from gateway.quota.limiter.resilient import ResilientStore
from gateway.quota.limiter.store import Charge

HOUR = 3600.0
_ids = itertools.count()


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    s = RedisServer(tmp_path_factory.mktemp("redis-leases"))
    yield s
    s.stop()


def _scope() -> str:
    return f"tenant:lease-{uuid.uuid4().hex[:8]}"


def _rid() -> str:
    return f"r{next(_ids)}"


async def _remaining(url: str, scope: str, limit: Limit) -> float:
    """What the shared bucket has left (a zero-cost reservation reports it)."""
    s = RedisStore.from_url(url)
    try:
        d = await s.reserve([Charge(scope, limit, 0.0)], _rid())
        return d.states[0].remaining
    finally:
        await s.close()


async def test_replicas_never_admit_above_the_bucket_and_give_back_what_they_hold(
        redis_server: RedisServer) -> None:
    scope = _scope()
    limit = Limit("tokens", 10_000, HOUR, 10_000)  # refills ~2.8 tokens/s: a fixed pot here
    replicas = [LeasedStore(RedisStore.from_url(redis_server.url), 0.02) for _ in range(3)]
    admitted = [0.0]

    async def client(store: LeasedStore) -> None:
        for _ in range(120):
            d = await store.reserve([Charge(scope, limit, 30.0)], _rid())
            if d.allowed:
                admitted[0] += 30.0

    await asyncio.gather(*(client(s) for s in replicas for _ in range(4)))
    held = sum(s.leases[(scope, "tokens")].balance for s in replicas)
    bound = 10_000 + 60.0  # the burst, plus what refills over the run's few seconds
    assert admitted[0] <= bound
    # under the bound by at most what replicas hold: one chunk (200) and a request each
    assert admitted[0] + held >= 10_000 - 3 * 30.0
    assert held <= 3 * 200.0
    # far fewer shared round trips than requests
    renewals = sum(s.lease_stats.renewals for s in replicas)
    assert renewals < admitted[0] / 30.0 / 3
    before = await _remaining(redis_server.url, scope, limit)
    for s in replicas:
        await s.close()
    after = await _remaining(redis_server.url, scope, limit)
    assert after == pytest.approx(before + held, abs=5.0)


async def test_settlement_is_local_exactly_once_and_an_overrun_reaches_the_bucket(
        redis_server: RedisServer) -> None:
    scope = _scope()
    limit = Limit("tokens", 100_000, HOUR, 100_000)
    store = LeasedStore(RedisStore.from_url(redis_server.url), 0.01)  # chunks of 1,000
    d = await store.reserve([Charge(scope, limit, 200.0)], _rid())
    assert d.allowed and d.reservation is not None
    lease = store.leases[(scope, "tokens")]
    assert lease.balance == pytest.approx(800.0)
    key = (scope, "tokens")
    assert await store.adjust(d.reservation, {key: -100.0}, "s1")  # 100 unused: refunded
    assert not await store.adjust(d.reservation, {key: -100.0}, "s1")  # a retry: ignored
    assert lease.balance == pytest.approx(900.0)
    trips = store.stats.round_trips
    assert await store.adjust(d.reservation, {key: 2_000.0}, "final")  # a big overrun
    assert lease.balance == 0.0
    assert not await store.adjust(d.reservation, {key: -50.0}, "late")  # after final
    remaining = await _remaining(redis_server.url, scope, limit)
    # taken: the lease (1,000) and the overrun past it (2,000 - 900)
    assert remaining == pytest.approx(100_000 - 1_000 - 1_100, abs=5.0)
    assert store.stats.round_trips >= trips
    await store.close()


async def test_a_busy_lease_goes_back_before_its_reservation_is_forgotten(
        redis_server: RedisServer) -> None:
    """A lease in steady use is never idle, but its returns and overruns are settled against
    the reservation it was taken as, which the shared store remembers for that reservation's
    life only: past half of it the lease goes back whole and the next request renews it."""
    scope = _scope()
    limit = Limit("tokens", 100_000, HOUR, 100_000)
    now = [0.0]
    store = LeasedStore(RedisStore.from_url(redis_server.url), 0.01, clock=lambda: now[0])
    key = (scope, "tokens")
    d = await store.reserve([Charge(scope, limit, 10.0)], _rid())
    assert d.allowed and d.reservation is not None
    first = store.leases[key].held
    assert first is not None
    for t in (1.0, 1.5):  # in use: not idle, and young
        now[0] = t
        assert (await store.reserve([Charge(scope, limit, 10.0)], _rid())).allowed
        assert await store.give_back(idle_only=True) == 0.0
    now[0] = first.life_s / 2 + 1.0
    assert (await store.reserve([Charge(scope, limit, 10.0)], _rid())).allowed  # still in use
    assert await store.give_back(idle_only=True) == pytest.approx(1_000.0 - 40.0)
    assert await _remaining(redis_server.url, scope, limit) == pytest.approx(
        100_000 - 40.0, abs=5.0)
    assert (await store.reserve([Charge(scope, limit, 10.0)], _rid())).allowed
    assert store.leases[key].held is not first  # renewed as a new reservation
    await store.close()


async def test_small_limits_reserve_per_request_on_the_shared_bucket(
        redis_server: RedisServer) -> None:
    scope = _scope()
    limit = Limit("requests", 20, HOUR, 20)  # a chunk of 0.4 requests covers none
    store = LeasedStore(RedisStore.from_url(redis_server.url), 0.02)
    allowed = 0
    for _ in range(25):
        d = await store.reserve([Charge(scope, limit, 1.0)], _rid())
        allowed += d.allowed
        if d.allowed and d.reservation is not None:
            assert await store.adjust(d.reservation, {}, "final")
    assert allowed == 20
    assert store.lease_stats.direct == 25 and not store.leases
    await store.close()


async def test_near_the_limit_a_lease_shrinks_to_the_request(
        redis_server: RedisServer) -> None:
    scope = _scope()
    limit = Limit("tokens", 2_000, HOUR, 2_000)
    other = RedisStore.from_url(redis_server.url)
    assert (await other.reserve([Charge(scope, limit, 1_850.0)], _rid())).allowed
    store = LeasedStore(RedisStore.from_url(redis_server.url), 0.1)  # chunks of 200
    d = await store.reserve([Charge(scope, limit, 40.0)], _rid())  # 150 left: < a chunk
    assert d.allowed
    assert store.leases[(scope, "tokens")].balance == pytest.approx(0.0, abs=1.0)
    for _ in range(2):
        assert (await store.reserve([Charge(scope, limit, 40.0)], _rid())).allowed
    refused = await store.reserve([Charge(scope, limit, 40.0)], _rid())  # ~30 left
    assert not refused.allowed and refused.denied is not None
    await store.close()
    await other.close()


async def test_optional_charges_are_leased_never_over_taken_and_never_refuse(
        redis_server: RedisServer) -> None:
    """A tier bucket leased as an optional charge, by three replicas at once: every request
    is admitted (its quota has room), the tier is taken no more than its bucket holds, and
    near its end the lease shrinks to the request before it is left out; a request whose
    tier is taken is settled locally with it."""
    quota, tier = _scope(), _scope().replace("tenant:", "reserved:")
    q, t = Limit("tokens", 1_000_000, HOUR, 1_000_000), Limit("tokens", 2_000, HOUR, 2_000)
    replicas = [LeasedStore(RedisStore.from_url(redis_server.url), 0.1) for _ in range(3)]
    taken, admitted = [0], [0]

    async def client(store: LeasedStore) -> None:
        for _ in range(40):
            d = await store.reserve([Charge(quota, q, 40.0)], _rid(),
                                    optional=[Charge(tier, t, 40.0)])
            admitted[0] += d.allowed
            taken[0] += d.optional

    await asyncio.gather(*(client(s) for s in replicas for _ in range(2)))
    assert admitted[0] == 240
    assert taken[0] * 40 <= 2_000 + 20  # the bucket (and what refills meanwhile)
    held = sum(s.leases[(tier, "tokens")].balance for s in replicas if (tier, "tokens")
               in s.leases)
    assert taken[0] * 40 + held >= 2_000 - 3 * 40  # short of it by what replicas hold
    store, fresh = replicas[0], _scope().replace("tenant:", "reserved:")
    d = await store.reserve([Charge(quota, q, 10.0)], _rid(), optional=[Charge(fresh, t, 10.0)])
    assert d.optional and d.reservation is not None
    lease = store.leases[(fresh, "tokens")]
    trips = store.stats.round_trips
    assert await store.adjust(d.reservation, {(fresh, "tokens"): -6.0}, "final")  # 4 served
    assert lease.balance == pytest.approx(200.0 - 4.0)  # back into the lease, no round trip
    assert store.stats.round_trips == trips
    for s in replicas:
        await s.close()


async def test_an_outage_keeps_the_leases_admitting_then_falls_back(tmp_path: Path) -> None:
    server = RedisServer(tmp_path)
    scope = _scope()
    limit = Limit("tokens", 100_000, HOUR, 100_000)
    leased = LeasedStore(RedisStore.from_url(server.url, socket_timeout=0.3,
                                             socket_connect_timeout=0.3), 0.01)
    store = ResilientStore(leased, fail_open=True, replicas=2, retry_s=0.1)
    try:
        assert (await store.reserve([Charge(scope, limit, 100.0)], _rid())).allowed
        server.stop()
        for _ in range(9):  # the rest of the 1,000-token lease: no Redis needed
            assert (await store.reserve([Charge(scope, limit, 100.0)], _rid())).allowed
        assert store.stats.fallbacks == 0
        d = await store.reserve([Charge(scope, limit, 100.0)], _rid())  # renewal: Redis gone
        assert d.allowed and store.stats.fallbacks == 1  # fail-open: the local share
        server.start()  # back (empty: no persistence): leases are taken from it again
        await asyncio.sleep(0.2)
        renewals = leased.lease_stats.renewals
        assert (await store.reserve([Charge(scope, limit, 100.0)], _rid())).allowed
        assert leased.lease_stats.renewals == renewals + 1 and store.stats.fallbacks == 1
    finally:
        server.stop()
        await leased.shared.close()
