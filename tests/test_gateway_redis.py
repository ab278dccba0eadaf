"""The gateway against a real Redis that dies and comes back: fail_open and fail_closed."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from conftest import RunningBackend
from gateway_stack import RunningGateway, start_gateway, write_policy
from redis_servers import RedisServer
from test_gateway_e2e import sha

Factory = Callable[..., RunningBackend]


def policy(url: str, mode: str) -> dict[str, object]:
    return {"version": 1,
            "settings": {"redis_failure": mode},
            "models": {"m": {"endpoints": [{"url": url}], "upstream_model": "llama-3-8b"}},
            "tenants": {"t": {"keys": [{"sha256": sha("k")}], "limits": {"rpm": 4}}},
            "routes": {"r": {"tenants": ["t"], "models": ["m"]}}}


def ask(base: str) -> httpx.Response:
    return httpx.post(f"{base}/v1/completions", headers={"Authorization": "Bearer k"},
                      json={"model": "m", "prompt": "x", "max_tokens": 1}, timeout=10)


@pytest.mark.parametrize("mode", ["fail_closed", "fail_open"])
def test_redis_outage(mode: str, backend_factory: Factory, tmp_path: Path) -> None:
    b = backend_factory(served_model_name="llama-3-8b", time_scale=0.01)
    redis = RedisServer(tmp_path / "redis")
    gw = start_gateway(write_policy(tmp_path / "p.yaml", policy(f"{b.url}/v1", mode)),
                       redis_url=redis.url)
    try:
        assert ask(gw.url).status_code == 200  # served through Redis (1 of 4 rpm)
        redis.stop()
        r = ask(gw.url)
        if mode == "fail_closed":
            assert r.status_code == 503 and r.headers["retry-after"] == "1"
            assert r.json()["error"]["code"] == "limiter_unavailable"
        else:
            # Local limits are this replica's share of 4 rpm: it counted itself alone.
            assert gw.state.store.replicas == 1  # type: ignore[attr-defined]
            assert r.status_code == 200
            assert [ask(gw.url).status_code for _ in range(4)] == [200, 200, 200, 429]
            metrics = httpx.get(f"{gw.url}/metrics").text
            line = next(x for x in metrics.splitlines()
                        if x.startswith("tokengate_limiter_local_fallbacks_total"))
            assert float(line.split()[-1]) >= 3
        redis.start()  # an empty Redis: its buckets start full again
        deadline = time.monotonic() + 10
        while True:
            r = ask(gw.url)
            if r.status_code == 200 and not gw.state.store.degraded:  # type: ignore[attr-defined]
                break
            assert time.monotonic() < deadline, r.text
            time.sleep(0.2)
        # Back on Redis: its 4 rpm apply again (1 used just now), no double counting.
        assert [ask(gw.url).status_code for _ in range(4)] == [200, 200, 200, 429]
    finally:
        gw.close()
        redis.stop()


def _counted(gws: list[RunningGateway], n: int) -> None:
    deadline = time.monotonic() + 10
    while any(g.state.store.replicas != n for g in gws):  # type: ignore[attr-defined]
        assert time.monotonic() < deadline, [g.state.store.replicas for g in gws]  # type: ignore[attr-defined]
        time.sleep(0.05)


def test_an_outage_admits_at_most_the_limits_whatever_the_replicas_do(
        backend_factory: Factory, tmp_path: Path) -> None:
    """fail_open, no replica count in the policy: two replicas count each other through
    Redis; Redis dies; each admits its half of 4 rpm on its own; a third replica started
    during the outage (an autoscaler's) has counted nobody and admits nothing locally (503);
    one of the two stops meanwhile and the other keeps its half. Across the fleet the outage
    admits 4 requests: the limit, never more. Redis back, the census counts again."""
    b = backend_factory(served_model_name="llama-3-8b", time_scale=0.01)
    redis = RedisServer(tmp_path / "redis")
    path = write_policy(tmp_path / "p.yaml", policy(f"{b.url}/v1", "fail_open"))
    g1, g2 = start_gateway(path, redis_url=redis.url), start_gateway(path, redis_url=redis.url)
    g3: RunningGateway | None = None
    try:
        _counted([g1, g2], 2)
        redis.stop()
        admitted = 0
        for g in (g1, g2):
            codes = [ask(g.url).status_code for _ in range(3)]
            assert codes == [200, 200, 429], codes  # 4 rpm / 2 replicas each
            admitted += codes.count(200)
        g3 = start_gateway(path, redis_url=redis.url)  # added during the outage
        r = ask(g3.url)
        assert r.status_code == 503 and r.json()["error"]["code"] == "limiter_unavailable"
        assert "counted" in r.json()["error"]["message"]
        g2.close()  # removed during the outage: g1 keeps its half, no more
        assert ask(g1.url).status_code == 429
        assert admitted == 4  # the limit across the fleet
        redis.start()
        _counted([g1, g3], 2)  # g2 left the count when it stopped
        assert ask(g3.url).status_code == 200
    finally:
        for g in (g1, g2, g3):
            if g is not None:
                g.close()
        redis.stop()


@pytest.mark.parametrize("mode", ["fail_closed", "fail_open"])
def test_redis_killed_and_restarted_under_load(mode: str, backend_factory: Factory,
                                               tmp_path: Path) -> None:
    """Four clients stream without pause while Redis dies and comes back: every request
    ends (no hang) with 200, or 503 + retry-after when failing closed; the gateway returns to
    Redis by itself, and in-flight requests admitted before the outage settle after it."""
    import threading

    b = backend_factory(served_model_name="llama-3-8b", time_scale=0.05)
    redis = RedisServer(tmp_path / "redis")
    doc = policy(f"{b.url}/v1", mode)
    doc["tenants"]["t"]["limits"] = {"rpm": 100_000, "tpm": 10_000_000}  # type: ignore[index]
    # every request reserved in Redis (no lease: a lease keeps admitting through an outage,
    # tests/test_quota_leases.py)
    doc.setdefault("settings", {})["quota_lease"] = 0  # type: ignore[index]
    gw = start_gateway(write_policy(tmp_path / "p.yaml", doc), redis_url=redis.url)
    statuses: list[int] = []
    stop = threading.Event()

    def client() -> None:
        with httpx.Client(timeout=10) as c:
            while not stop.is_set():
                r = c.post(f"{gw.url}/v1/completions", headers={"Authorization": "Bearer k"},
                           json={"model": "m", "prompt": "x", "max_tokens": 8,
                                 "stream": True})
                statuses.append(r.status_code)
                if r.status_code == 503:
                    assert r.headers["retry-after"] == "1"

    threads = [threading.Thread(target=client) for _ in range(4)]
    try:
        for t in threads:
            t.start()
        time.sleep(1.0)
        redis.stop()
        time.sleep(1.5)
        redis.start()
        back = time.monotonic()
        while gw.state.store.degraded:  # type: ignore[attr-defined]
            assert time.monotonic() < back + 10, "did not return to Redis"
            time.sleep(0.05)
        print(f"\nredis {mode} under load: back on Redis {time.monotonic() - back:.2f} s "
              f"after it restarted; {statuses.count(503)} answered 503 meanwhile")
        time.sleep(1.0)
        stop.set()
        for t in threads:
            t.join(15)
            assert not t.is_alive(), "a request hung"
        assert set(statuses) <= ({200, 503} if mode == "fail_closed" else {200})
        assert statuses.count(200) > 20 and statuses[-1] == 200
        if mode == "fail_closed":
            assert 503 in statuses
        keys = subprocess.run(["redis-cli", "-p", str(redis.port), "--scan"],
                              capture_output=True, text=True).stdout
        assert "tenant:t" in keys  # quotas are kept in Redis again
    finally:
        stop.set()
        gw.close()
        redis.stop()


def test_no_tokengate_key_outlives_its_bound(backend_factory: Factory, tmp_path: Path) -> None:
    """Idempotency markers live as long as a settlement can take (the route's hold + queue +
    total timeouts + 60 s), one per request however many steps it settled in (a quota
    lease's, one per renewal, the default reservation life: it goes back within half of it);
    a bucket lives its own period plus tolerance."""
    import redis as redis_py

    from gateway.quota.limiter.store import DEFAULT_LIFE_S, SETTLE_MARGIN_S

    b = backend_factory(served_model_name="llama-3-8b", time_scale=0.01)
    server = RedisServer(tmp_path / "redis")
    doc = policy(f"{b.url}/v1", "fail_closed")
    doc["settings"] = {"progressive_charge_tokens": 2}
    doc["tenants"]["t"]["limits"] = {"rpm": 10_000, "tpm": 1_000_000}  # type: ignore[index]
    doc["routes"]["r"]["timeouts"] = {"total_s": 30}  # type: ignore[index]
    gw = start_gateway(write_policy(tmp_path / "p.yaml", doc), redis_url=server.url)
    n = 12
    try:
        for i in range(n):
            r = httpx.post(f"{gw.url}/v1/completions", headers={"Authorization": "Bearer k"},
                           json={"model": "m", "prompt": f"x {i}", "max_tokens": 300,
                                 "stream": i % 2 == 0}, timeout=10)
            assert r.status_code == 200
        deadline = time.monotonic() + 5
        while gw.state.background and time.monotonic() < deadline:
            time.sleep(0.02)
        route = gw.state.view.policy.routes["r"]
        bound_ms = ((route.hold_timeout_ms + route.queue_ms) / 1000.0 + 30 + SETTLE_MARGIN_S
                    ) * 1000
        r = redis_py.Redis.from_url(server.url)
        keys = [k.decode() for k in r.scan_iter("tg:*")]
        markers = [k for k in keys if ":s:" in k]
        assert 0 < len(markers) <= n  # at most one per request, however many steps
        for k in markers:
            assert 0 < r.pttl(k) <= (DEFAULT_LIFE_S * 1000 if ":s:lease-" in k else bound_ms), k
        for k in set(keys) - set(markers):  # buckets: period + tolerance (a minute each) + 1 s
            assert 0 < r.pttl(k) <= 121_000, k
        r.close()
    finally:
        gw.close()
        server.stop()
