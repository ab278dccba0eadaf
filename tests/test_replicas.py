"""Several gateway replicas sharing Redis: prefix-affinity hints shared so that a conversation
stays on one endpoint whichever replica gets each turn; the whole gateway on a 3-master Redis
Cluster, one master killed and brought back."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import RunningBackend
from gateway_stack import RunningGateway, start_gateway, write_policy
from redis_servers import RedisCluster, RedisServer
from test_gateway_e2e import sha

Factory = Callable[..., RunningBackend]
AUTH = {"Authorization": "Bearer k"}


def policy(urls: list[str], **over: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "version": 1, "settings": {"expose_endpoints": True},
        "models": {"m": {"endpoints": [{"url": u} for u in urls], "default_max_tokens": 2,
                         "routing": {"strategy": "prefix"}}},
        "tenants": {"t": {"keys": [{"sha256": sha("k")}]}},
        "routes": {"r": {"tenants": ["t"], "models": ["m"]}}}
    doc.update(over)
    return doc


def ask(gw: RunningGateway, prompt: str = "x") -> httpx.Response:
    return httpx.post(f"{gw.url}/v1/completions", headers=AUTH, timeout=30,
                      json={"model": "m", "prompt": prompt, "max_tokens": 2})


def test_replicas_share_prefix_hints(backend_factory: Factory, tmp_path: Path) -> None:
    backends = [backend_factory(served_model_name="m", time_scale=0.01) for _ in range(3)]
    redis = RedisServer(tmp_path / "redis")
    path = write_policy(tmp_path / "p.yaml", policy([f"{b.url}/v1" for b in backends]))
    a, b = start_gateway(path, redis_url=redis.url), start_gateway(path, redis_url=redis.url)
    try:
        time.sleep(0.3)  # both follow the hint stream
        placed: dict[int, set[str]] = {}
        for conv in range(8):
            for _ in range(conv % 3):  # other traffic, on one replica only
                assert ask(a).status_code == 200
            history = f"conversation {conv}: " + " ".join(f"w{conv}x{i}" for i in range(300))
            for turn in range(4):
                history += f" turn {turn} " + " ".join(f"t{turn}y{i}" for i in range(40))
                gw = (a, b)[(conv + turn) % 2]  # a round-robin front
                r = ask(gw, history)
                assert r.status_code == 200
                placed.setdefault(conv, set()).add(r.headers["x-tokengate-endpoint"])
                time.sleep(0.05)  # a user's think time: longer than a flush
        # Every conversation stayed where its first turn went, though each replica saw only
        # every other turn; and conversations were spread over the endpoints.
        assert all(len(eps) == 1 for eps in placed.values()), placed
        assert len({next(iter(eps)) for eps in placed.values()}) >= 2
        assert a.state.share is not None and b.state.share is not None
        assert a.state.share.received > 0 and b.state.share.received > 0
    finally:
        a.close()
        b.close()
        redis.stop()


def _node_with_keys(cluster: RedisCluster, required: bool = True) -> Any:
    """The node holding the tenant's buckets (None, when not ``required``, if none does)."""
    for node in cluster.nodes:
        out = subprocess.run(["redis-cli", "-p", str(node.port), "--scan", "--pattern",
                              "*tenant:t*"], capture_output=True, text=True).stdout
        if out.strip():
            return node
    if required:
        raise AssertionError("no node holds the tenant's buckets")
    return None


@pytest.mark.parametrize("mode", ["fail_closed", "fail_open"])
def test_gateway_on_a_redis_cluster_survives_a_master(mode: str, backend_factory: Factory,
                                                      tmp_path: Path) -> None:
    be = backend_factory(served_model_name="m", time_scale=0.01)
    cluster = RedisCluster(tmp_path / "cluster")
    # every request reserved in Redis (no lease): what a lost master does to that path; a
    # lease keeps admitting through an outage (tests/test_quota_leases.py)
    doc = policy([f"{be.url}/v1"], settings={"redis_failure": mode, "quota_lease": 0})
    doc["tenants"]["t"]["limits"] = {"rpm": 1000}
    gw = start_gateway(write_policy(tmp_path / "p.yaml", doc),
                       redis_url=cluster.url)
    try:
        assert ask(gw).status_code == 200
        node = _node_with_keys(cluster)
        node.stop()
        r = ask(gw)
        if mode == "fail_closed":
            assert r.status_code == 503 and r.json()["error"]["code"] == "limiter_unavailable"
            assert r.headers["retry-after"] == "1"
        else:
            assert r.status_code == 200  # on this replica's local share of the limits
        node.start()  # rejoins the cluster with its slots (its data is gone: no persistence)
        back = time.monotonic()
        while True:
            r = ask(gw)
            if r.status_code == 200 and not gw.state.store.degraded:  # type: ignore[attr-defined]
                break
            assert time.monotonic() - back < 15, r.text
            time.sleep(0.2)
        print(f"\ncluster {mode}: back on Redis {time.monotonic() - back:.1f} s after the "
              "master restarted")
        # the buckets live in Redis again (the 200 above may still have been served by the
        # local share, its outage window ending as it was: the next requests reserve there)
        holder = None
        for _ in range(25):
            holder = _node_with_keys(cluster, required=False)
            if holder is not None:
                break
            assert ask(gw).status_code == 200
            time.sleep(0.2)
        assert holder is node
    finally:
        gw.close()
        cluster.stop()
