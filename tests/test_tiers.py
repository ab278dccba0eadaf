"""Capacity tiers: within its reserved throughput a tenant's requests are ``reserved`` (and
priced so), beyond it ``payg``, flex requests ``flex`` at their discount; the response says
which. A reserved request that arrives while a flood fills the pool goes at once (its capacity
was lent while idle and is reclaimed on the next decision)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
from conftest import RunningBackend
from gateway_stack import start_gateway, write_policy
from redis_servers import RedisServer
from test_gateway_e2e import sha

from gateway.config.flow import FlowControl
from gateway.config.policy import Model
from gateway.flow.gate import Gate
from gateway.flow.waiter import Waiter
from gateway.quota.limiter.redis_store import RedisStore
from gateway.routing.endpoints import EndpointPool, EndpointState


def doc(url: str) -> dict[str, Any]:
    return {"version": 1, "settings": {"admin_key_sha256": sha("admin-key"),
                                       "spend": {"log": False}},
            "models": {"m": {"endpoints": [{"url": url}], "upstream_model": "llama-3-8b",
                             "default_max_tokens": 10,
                             "price": {"input_per_1k": 1.0, "output_per_1k": 1.0,
                                       "reserved": 0.25, "flex": 0.5}}},
            "tenants": {"r": {"keys": [{"sha256": sha("key-r")}], "reserved": {"m": 150},
                              "max_priority": "standard"}},
            "routes": {"x": {"tenants": ["r"], "models": ["m"]}}}


def test_tiers_are_said_and_priced(backend_factory: Callable[..., RunningBackend],
                                   tmp_path: Path) -> None:
    b = backend_factory()
    gw = start_gateway(write_policy(tmp_path / "p.yaml", doc(f"{b.url}/v1")))
    try:
        def ask(priority: str | None = None) -> httpx.Response:
            h = {"Authorization": "Bearer key-r", **({"x-priority": priority} if priority
                                                      else {})}
            return httpx.post(f"{gw.url}/v1/completions", headers=h, timeout=30, json={
                "model": "m", "prompt": "word " * 40, "max_tokens": 10})

        tiers = [ask().headers["x-tokengate-tier"] for _ in range(4)]
        # ~51 tokens each against 150/min reserved: the first two fit, then pay-as-you-go
        assert tiers[:2] == ["reserved", "reserved"] and tiers[-1] == "payg", tiers
        flex = ask("flex")
        assert flex.status_code == 200 and flex.headers["x-tokengate-tier"] == "flex"
        admin = {"Authorization": "Bearer admin-key"}
        rows = httpx.get(f"{gw.url}/admin/spend", params={"by": "tier"},
                         headers=admin).json()["rows"]
        by = {r["tier"]: r for r in rows}
        for tier, factor in (("reserved", 0.25), ("payg", 1.0), ("flex", 0.5)):
            r = by[tier]
            list_price = (r["prompt_tokens"] + r["completion_tokens"]) / 1000
            assert abs(r["dollars"] - factor * list_price) < 1e-9, (tier, r)
        metrics = httpx.get(f"{gw.url}/metrics", headers=admin).text
        assert 'tokengate_tier_requests_total{model="m",tier="reserved"} 2.0' in metrics
    finally:
        gw.close()


def _redis_store(store: Any) -> RedisStore:
    while not isinstance(store, RedisStore):
        store = getattr(store, "primary", None) or store.shared
    return store


def test_two_replicas_share_the_reserved_throughput_in_the_quotas_own_round_trip(
        backend_factory: Callable[..., RunningBackend], tmp_path: Path) -> None:
    """Two replicas sharing a real Redis, without quota leases: the reserved throughput is
    one bucket for both (two requests of ~51 tokens fit in 150, whichever replica takes
    them), and a request with a reservation costs as many Redis calls as one of a tenant
    without (``p``): the tier charge rides the quota's own reservation and settlement."""
    b = backend_factory()
    redis = RedisServer(tmp_path / "redis")
    d = doc(f"{b.url}/v1")
    d["settings"]["quota_lease"] = 0
    d["tenants"]["r"]["limits"] = {"tpm": 100_000}
    d["tenants"]["p"] = {"keys": [{"sha256": sha("key-p")}], "limits": {"tpm": 100_000}}
    d["routes"]["x"]["tenants"].append("p")
    pol = write_policy(tmp_path / "p.yaml", d)
    gws = [start_gateway(pol, redis.url) for _ in range(2)]
    try:
        stores = [_redis_store(g.state.store) for g in gws]

        def ask(gw: Any, key: str) -> tuple[str, int]:
            before = sum(s.stats.round_trips for s in stores)
            r = httpx.post(f"{gw.url}/v1/completions", timeout=30,
                           headers={"Authorization": f"Bearer {key}"},
                           json={"model": "m", "prompt": "word " * 40, "max_tokens": 10})
            assert r.status_code == 200
            time.sleep(0.3)  # its settlement runs after the answer
            return r.headers["x-tokengate-tier"], sum(s.stats.round_trips
                                                      for s in stores) - before

        runs = [ask(gws[i % 2], key) for i in range(4) for key in ("key-r", "key-p")]
        tiers = [t for t, _ in runs[::2]]
        # ~51 tokens reserved each (what was not served goes back, and 2.5 a second refill):
        # the bucket is one, whichever replica asks
        assert tiers[:2] == ["reserved", "reserved"] and tiers[-1] == "payg", tiers
        assert {t for t, _ in runs[1::2]} == {"payg"}
        assert [n for _, n in runs[::2]] == [n for _, n in runs[1::2]], runs
    finally:
        for g in gws:
            g.close()
        redis.stop()


def test_reserved_capacity_is_reclaimed_on_the_next_decision() -> None:
    eps = [EndpointState("http://127.0.0.1:9000/v1")]
    pool = EndpointPool(Model("m", ()), eps)
    gate = Gate(FlowControl(mode="fair", queue_depth=1), lambda: eps)
    assert gate.offer(Waiter("flood", "standard", 0.0, 100, 10), 0.0).go
    pool.acquire(eps[0], 110, 100)
    gate.sent()
    flood = [Waiter("flood", "standard", float(i), 100, 10) for i in range(20)]
    assert not any(gate.offer(w, 0.0).go for w in flood)  # the pool is lent to the flood
    back = Waiter("owner", "reserved", 0.0, 100, 10)
    assert gate.offer(back, 0.0).go  # its reservation returns: it goes now, not after 20
    assert all(w.queued for w in flood)


def test_a_failed_request_gives_its_reserved_throughput_back(tmp_path: Path) -> None:
    import asyncio

    from gateway.quota.limiter.bucket import Limit
    from gateway.quota.limiter.store import Charge

    gw = start_gateway(write_policy(tmp_path / "p.yaml", doc("http://127.0.0.1:9/v1")))
    try:
        r = httpx.post(f"{gw.url}/v1/completions", timeout=30, headers={
            "Authorization": "Bearer key-r"}, json={"model": "m", "prompt": "word " * 40,
                                                    "max_tokens": 10})
        assert r.status_code >= 500  # nothing listens there
        bucket = Charge("reserved:r|model:m", Limit("tokens", 150, 60.0, 150), 0.0)
        for _ in range(100):
            (state,) = asyncio.run(gw.state.store.peek([bucket]))
            if state.remaining >= 149:
                break
            time.sleep(0.02)
        assert state.remaining >= 149  # reserved for ~51 tokens, all of it back
    finally:
        gw.close()


def spill_doc(big: str, small: str) -> dict[str, Any]:
    return {"version": 1, "settings": {"admin_key_sha256": sha("admin-key"),
                                       "spend": {"log": False},
                                       "flow_control": {"mode": "fair", "queue_depth": 1}},
            "models": {"m": {"endpoints": [{"url": big}], "upstream_model": "llama-3-8b",
                             "default_max_tokens": 40, "spillover": "o",
                             "price": {"input_per_1k": 1.0, "output_per_1k": 1.0}},
                       "o": {"endpoints": [{"url": small}], "upstream_model": "llama-3-8b",
                             "default_max_tokens": 40,
                             "price": {"input_per_1k": 3.0, "output_per_1k": 3.0}}},
            "tenants": {"p": {"keys": [{"sha256": sha("key-p")}],
                              # room on the spillover model for two requests of ~81 tokens
                              "model_limits": {"o": {"tpm": 170}}},
                        "r": {"keys": [{"sha256": sha("key-r")}], "reserved": {"m": 100000}}},
            "routes": {"x": {"tenants": ["p", "r"], "models": ["m", "o"]}}}


def test_payg_spills_over_while_the_pool_is_saturated_and_reserved_never_does(
        backend_factory: Callable[..., RunningBackend], tmp_path: Path) -> None:
    """One engine running one sequence at a time, ``queue_depth: 1``: with two requests on
    it the pool is saturated. Pay-as-you-go requests then go to the spillover model while its
    quota lasts (two fit), priced there and said so; the rest wait for their own pool. A
    reserved tenant's requests never spill."""
    from concurrent.futures import ThreadPoolExecutor

    big = backend_factory(time_scale=0.5, max_num_seqs=1)
    small = backend_factory()
    gw = start_gateway(write_policy(tmp_path / "p.yaml", spill_doc(f"{big.url}/v1",
                                                                   f"{small.url}/v1")))
    try:
        def ask(key: str) -> httpx.Response:
            return httpx.post(f"{gw.url}/v1/completions", timeout=60, headers={
                "Authorization": f"Bearer {key}"}, json={
                "model": "m", "prompt": "word " * 40, "max_tokens": 40})

        with ThreadPoolExecutor(8) as ex:
            payg = list(ex.map(ask, ["key-p"] * 8))
        assert all(r.status_code == 200 for r in payg), [r.text for r in payg]
        spilled = [r for r in payg if r.headers.get("x-tokengate-failover") == "spillover"]
        assert len(spilled) == 2, [dict(r.headers) for r in payg]
        assert all(r.headers["x-tokengate-model"] == "o" and r.headers["x-tokengate-tier"]
                   == "payg" for r in spilled)
        stayed = [r for r in payg if r not in spilled]
        assert all(r.headers["x-tokengate-model"] == "m" for r in stayed)
        with ThreadPoolExecutor(6) as ex:
            reserved = list(ex.map(ask, ["key-r"] * 6))
        assert all(r.status_code == 200 and r.headers["x-tokengate-model"] == "m"
                   and r.headers["x-tokengate-tier"] == "reserved"
                   and "x-tokengate-failover" not in r.headers for r in reserved)
        admin = {"Authorization": "Bearer admin-key"}
        rows = httpx.get(f"{gw.url}/admin/spend", params={"by": "model"},
                         headers=admin).json()["rows"]
        by = {r["model"]: r for r in rows}
        assert by["o"]["requests"] == 2
        tokens = by["o"]["prompt_tokens"] + by["o"]["completion_tokens"]
        assert abs(by["o"]["dollars"] - 3.0 * tokens / 1000) < 1e-9, by["o"]
        metrics = httpx.get(f"{gw.url}/metrics", headers=admin).text
        assert 'tokengate_failovers_total{from_model="m",reason="spillover",to_model="o"} 2.0' \
            in metrics, [x for x in metrics.splitlines() if "failovers" in x]
    finally:
        gw.close()


def test_a_share_of_the_pool_follows_its_healthy_endpoints() -> None:
    from gateway.config.decode import Decoder
    from gateway.config.policy import _tenant

    m = Model("m", (), capacity_tpm=60_000.0)
    t = _tenant(Decoder("p.yaml"), "t", {"keys": [{"sha256": "0" * 64}],
                                         "reserved": {"m": "25%", "n": 500}}, "tenants.t")
    assert t.reserved_tpm(m, 4) == 60_000.0  # a quarter of four endpoints' capacity
    assert t.reserved_tpm(m, 2) == 30_000.0  # the pool shrank: so did the reservation
    assert t.reserved_tpm(Model("n", ()), 4) == 500.0


def test_a_bad_reservation_is_refused_with_its_path(tmp_path: Path) -> None:
    from gateway.config.decode import PolicyError
    from gateway.config.policy import load_policy

    base = doc("http://127.0.0.1:9/v1")
    for value, says in (("150%", "at most 100%"), ("lots%", "percentage"),
                        ("25%", "capacity_tpm")):
        base["tenants"]["r"]["reserved"] = {"m": value}
        path = write_policy(tmp_path / "bad.yaml", base)
        try:
            load_policy(path)
        except PolicyError as exc:
            assert "tenants.r.reserved.m" in str(exc) and says in str(exc), str(exc)
        else:
            raise AssertionError(f"{value} was accepted")
