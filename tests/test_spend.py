"""Spend records: one per request (served or refused), to the spend log and to a real
PostgreSQL (created and migrated by the gateway), with the dollars the price says; dollar
metrics; ``/admin/spend`` by tenant, key and model, the fleet's across two replicas sharing a
real Redis."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import openai
import pytest
from conftest import RunningBackend
from gateway_stack import RunningGateway, start_gateway, write_policy
from redis_servers import RedisServer
from test_gateway_e2e import sha

PG = "postgresql://127.0.0.1:5432/test"
ADMIN = {"Authorization": "Bearer admin-key"}


def doc(url: str, **settings: Any) -> dict[str, Any]:
    return {"version": 1, "settings": {"admin_key_sha256": sha("admin-key"), **settings},
            "models": {"m": {"endpoints": [{"url": url}], "upstream_model": "llama-3-8b",
                             "default_max_tokens": 8,
                             "price": {"input_per_1k": 0.5, "output_per_1k": 1.5}}},
            "tenants": {"t": {"keys": [{"name": "prod", "sha256": sha("key-prod")},
                                       {"name": "ci", "sha256": sha("key-ci")}],
                              "limits": {"rpm": 4}}},
            "routes": {"r": {"tenants": ["t"], "models": ["m"]}}}


def wait_for(check: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.05)
    raise AssertionError("timed out")


async def rows_for(ids: list[str]) -> list[Any]:
    conn = await asyncpg.connect(PG)
    try:
        return list(await conn.fetch("SELECT * FROM tokengate_spend WHERE request_id = "
                                     "ANY($1::text[]) ORDER BY at", ids))
    finally:
        await conn.close()


def test_every_request_is_recorded_with_its_dollars(
        backend_factory: Callable[..., RunningBackend], tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    b = backend_factory()
    gw = start_gateway(write_policy(tmp_path / "p.yaml",
                                    doc(f"{b.url}/v1", spend={"postgres_url": PG})))
    caplog.set_level(logging.INFO, logger="tokengate.spend")
    try:
        ids = [f"spend-{uuid.uuid4().hex}" for _ in range(5)]
        usage = {}
        for i, rid in enumerate(ids):
            key = "key-prod" if i % 2 == 0 else "key-ci"
            c = openai.OpenAI(base_url=f"{gw.url}/v1", api_key=key, max_retries=0)
            try:
                r = c.completions.create(model="m", prompt=f"hello {i} " * 10, max_tokens=4,
                                         extra_headers={"x-request-id": rid,
                                                        "x-fairness-id": f"s{i}"})
                assert r.usage is not None
                usage[rid] = (r.usage.prompt_tokens, r.usage.completion_tokens)
            except openai.RateLimitError:
                pass  # rpm 4: the fifth is refused, and recorded too
        assert len(usage) == 4
        got = asyncio.run(_poll(ids))
        by_id = {row["request_id"]: row for row in got}
        assert set(by_id) == set(ids)
        for rid, (p, o) in usage.items():
            row = by_id[rid]
            assert (row["prompt_tokens"], row["completion_tokens"]) == (p, o)
            assert row["dollars"] == pytest.approx(p * 0.5 / 1000 + o * 1.5 / 1000)
            assert row["outcome"] == "200" and row["tenant"] == "t" and row["model"] == "m"
            assert row["endpoint"] == f"{b.url}/v1" and row["session"].startswith("s")
        refused = by_id[ids[4]]
        assert refused["outcome"] == "429" and refused["dollars"] == 0
        assert [by_id[i]["key_name"] for i in ids] == ["prod", "ci", "prod", "ci", "prod"]
        logged = [json.loads(r.getMessage()) for r in caplog.records
                  if r.name == "tokengate.spend" and r.getMessage().startswith("{")]
        assert {x["request_id"] for x in logged} >= set(ids)
        total = sum(by_id[i]["dollars"] for i in usage)
        metrics = httpx.get(f"{gw.url}/metrics", headers=ADMIN).text
        line = next(x for x in metrics.splitlines()
                    if x.startswith('tokengate_spend_dollars_total{model="m",tenant="t"}'))
        assert float(line.split()[-1]) == pytest.approx(total)
        spend = httpx.get(f"{gw.url}/admin/spend", params={"by": "tenant,key"},
                          headers=ADMIN).json()
        rows = {(r["tenant"], r["key"]): r for r in spend["rows"]}
        assert rows[("t", "prod")]["requests"] == 3 and rows[("t", "ci")]["requests"] == 2
        assert sum(r["dollars"] for r in rows.values()) == pytest.approx(total)
        bad = httpx.get(f"{gw.url}/admin/spend", params={"by": "colour"}, headers=ADMIN)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "by"
    finally:
        gw.close()


async def _poll(ids: list[str]) -> list[Any]:
    for _ in range(100):
        try:
            got = await rows_for(ids)
        except asyncpg.UndefinedTableError:
            got = []
        if len(got) == len(ids):
            return got
        await asyncio.sleep(0.1)
    return await rows_for(ids)


def test_two_replicas_report_the_fleets_spend(
        backend_factory: Callable[..., RunningBackend], tmp_path: Path) -> None:
    b = backend_factory()
    redis = RedisServer(tmp_path / "redis")
    path = write_policy(tmp_path / "p.yaml", doc(f"{b.url}/v1", spend={"log": False}))
    one: RunningGateway = start_gateway(path, redis_url=redis.url)
    two: RunningGateway = start_gateway(path, redis_url=redis.url)
    try:
        for gw, n in ((one, 1), (two, 2)):
            c = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="key-prod", max_retries=0)
            for _ in range(n):
                c.completions.create(model="m", prompt="hi", max_tokens=2)

        def fleet(gw: RunningGateway) -> list[dict[str, Any]]:
            return httpx.get(f"{gw.url}/admin/spend", params={"by": "tenant"},
                             headers=ADMIN).json()["rows"]  # type: ignore[no-any-return]

        wait_for(lambda: [r["requests"] for r in fleet(one)] == [3]
                 and fleet(two) == fleet(one))
    finally:
        one.close()
        two.close()
        redis.stop()


def test_spend_over_sliding_windows_by_session_across_replicas(
        backend_factory: Callable[..., RunningBackend], tmp_path: Path) -> None:
    """``/admin/spend?window=``: two replicas on one real Redis answer the same sums by
    session (``x-fairness-id``) and by tenant over the last hour; a malformed window, or
    sessions over a window longer than the minute buckets keep, is a 400 in OpenAI's shape."""
    b = backend_factory()
    redis = RedisServer(tmp_path / "redis")
    path = write_policy(tmp_path / "p.yaml", doc(f"{b.url}/v1", spend={"log": False}))
    one: RunningGateway = start_gateway(path, redis_url=redis.url)
    two: RunningGateway = start_gateway(path, redis_url=redis.url)
    try:
        for gw, session, n in ((one, "agent-1", 2), (two, "agent-2", 1), (two, None, 1)):
            c = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="key-ci", max_retries=0,
                              default_headers={"x-fairness-id": session} if session else {})
            for _ in range(n):
                c.completions.create(model="m", prompt="hi", max_tokens=2)

        def window(gw: RunningGateway, by: str, w: str = "1h") -> httpx.Response:
            return httpx.get(f"{gw.url}/admin/spend", params={"by": by, "window": w},
                             headers=ADMIN)

        def sessions(gw: RunningGateway) -> dict[str | None, int]:
            return {r["session"]: r["requests"] for r in window(gw, "session").json()["rows"]}

        wait_for(lambda: sessions(one) == {"agent-1": 2, "agent-2": 1, None: 1}
                 and sessions(two) == sessions(one))
        body = window(one, "tenant,key").json()
        assert [(r["tenant"], r["key"], r["requests"]) for r in body["rows"]] == [
            ("t", "ci", 4)]
        assert body["rows"][0]["dollars"] > 0 and body["bucket_s"] == 60
        assert body["to"] - body["from"] <= 3600 + 60
        day = window(one, "tenant", "24h").json()
        assert day["bucket_s"] == 3600 and day["rows"][0]["requests"] == 4
        for params, param in (({"window": "1 fortnight"}, "window"),
                              ({"window": "9d"}, "window"),
                              ({"window": "24h", "by": "session"}, "window"),
                              ({"window": "1h", "by": "day"}, "by")):
            r = httpx.get(f"{one.url}/admin/spend", params=params, headers=ADMIN)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    finally:
        one.close()
        two.close()
        redis.stop()


def test_a_window_sums_whole_buckets_back_from_now() -> None:
    from gateway.spend.windows import Windows

    w = Windows("unused:")
    now = 1_800_000_000.0 + 30  # 30 s into a minute
    cell = ("t", "k", "m", "standard", "payg", "")
    for age in (10, 3590, 3700):  # seconds ago
        w.add(now - age, cell, (1.0, 10.0, 5.0, 0.0, 0.01))
    hour = asyncio.run(w.spend(None, now, 3600.0, ("tenant",)))
    assert hour["rows"][0]["requests"] == 2  # 3700 s ago is outside the last hour's minutes
    assert hour["from"] <= now - 3600 and hour["from"] > now - 3660
    day = asyncio.run(w.spend(None, now, 86400.0, ("tenant",)))
    assert day["rows"][0]["requests"] == 3 and day["bucket_s"] == 3600


def test_a_records_day_is_its_time_zones_even_across_midnight() -> None:
    """The day is remembered for a minute at a time; Kolkata's midnight (UTC+5:30) falls
    inside a UTC hour, and the records either side of it get their own days."""
    from datetime import datetime
    from zoneinfo import ZoneInfo

    from gateway.metrics import GatewayMetrics
    from gateway.spend.ledger import SpendLedger

    zone = ["Asia/Kolkata"]
    ledger = SpendLedger(GatewayMetrics(), time_zone=lambda: zone[0])
    midnight = datetime(2026, 12, 4, tzinfo=ZoneInfo("Asia/Kolkata")).timestamp()
    assert ledger.day(midnight - 0.5) == "2026-12-03"
    assert ledger.day(midnight - 0.25) == "2026-12-03"
    assert ledger.day(midnight) == "2026-12-04"
    assert ledger.day(midnight - 0.5) == "2026-12-03"
    zone[0] = "UTC"  # a reload to another zone: read again
    assert ledger.day(midnight) == "2026-12-03"
