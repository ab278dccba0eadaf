"""Calendar budgets: dollars per day and per month that reset at midnight (on the 1st) in the
policy's time zone, beside the rolling budget; a spent one refuses with ``type: dollars`` until
its window ends, and the next window is a fresh bucket."""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import httpx
import pytest
from conftest import RunningBackend
from gateway_stack import start_gateway, write_policy
from test_gateway_e2e import sha

from gateway.config.policy import PolicyError, parse_policy
from gateway.quota import calendar
from gateway.quota.ledger import charges


def ts(iso: str) -> float:
    return datetime.fromisoformat(iso).timestamp()


def test_windows_begin_at_local_midnight_and_on_the_first() -> None:
    # 23:30 UTC is already the next day in Paris (UTC+1 in December)
    assert calendar.window("budget_daily", ts("2026-12-02T23:30:00+00:00"), "Europe/Paris") \
        == ("2026-12-03", ts("2026-12-03T23:00:00+00:00"))
    assert calendar.window("budget_monthly", ts("2026-12-31T23:30:00+00:00"), "Europe/Paris") \
        == ("2027-01", ts("2027-01-31T23:00:00+00:00"))
    assert calendar.window("budget_monthly", ts("2026-02-10T12:00:00+00:00"), "UTC") \
        == ("2026-02", ts("2026-03-01T00:00:00+00:00"))
    # the day clocks spring forward is 23 hours long, and still ends at local midnight
    label, end = calendar.window("budget_daily", ts("2026-03-08T12:00:00-04:00"),
                                 "America/New_York")
    assert label == "2026-03-08" and end == ts("2026-03-09T00:00:00-04:00")


def _doc(limits: dict[str, float], url: str = "http://127.0.0.1:1/v1",
         tz: str = "UTC") -> dict[str, object]:
    return {"version": 1, "settings": {"time_zone": tz, "admin_key_sha256": sha("admin")},
            "models": {"m": {"endpoints": [{"url": url}], "upstream_model": "llama-3-8b",
                             "default_max_tokens": 8,
                             "price": {"input_per_1k": 1.0, "output_per_1k": 2.0}}},
            "tenants": {"t": {"keys": [{"sha256": sha("key-t")}], "limits": limits}},
            "routes": {"r": {"tenants": ["t"], "models": ["m"]}}}


def test_charges_name_the_window_and_a_bad_time_zone_is_refused() -> None:
    p = parse_policy(_doc({"budget_daily": 5, "budget_monthly": 100}))
    cs = charges(p, "t", p.routes["r"], p.models["m"], 1000, 500)
    today = datetime.now(UTC)
    by = {c.scope: c for c in cs}
    daily = by[f"tenant:t@{today:%Y-%m-%d}"]
    monthly = by[f"tenant:t@{today:%Y-%m}"]
    assert daily.limit.kind == "budget_daily" and monthly.limit.kind == "budget_monthly"
    assert daily.cost == monthly.cost == pytest.approx(1.0 + 1.0)  # $1/1K in, $2/1K out
    with pytest.raises(PolicyError, match=r"time_zone.*unknown time zone"):
        parse_policy(_doc({"budget_daily": 5}, tz="Mars/Olympus"))


def test_a_spent_daily_budget_refuses_until_midnight(
        backend_factory: Callable[..., RunningBackend], tmp_path: Path) -> None:
    b = backend_factory()
    gw = start_gateway(write_policy(tmp_path / "p.yaml", _doc({"budget_daily": 0.05},
                                                              f"{b.url}/v1")))
    try:
        auth = {"Authorization": "Bearer key-t"}
        body = {"model": "m", "prompt": "hello " * 20, "max_tokens": 8}
        first = httpx.post(f"{gw.url}/v1/completions", json=body, headers=auth, timeout=30)
        assert first.status_code == 200
        statuses = [first.status_code]
        for _ in range(60):  # ~$0.04 a request: the second or third is refused
            r = httpx.post(f"{gw.url}/v1/completions", json=body, headers=auth, timeout=30)
            statuses.append(r.status_code)
            if r.status_code != 200:
                break
        assert r.status_code == 429, statuses
        err = r.json()["error"]
        assert err["type"] == "dollars" and err["code"] == "budget_exceeded"
        assert "calendar day" in err["message"] and "resets at" in err["message"]
        now = datetime.now(UTC)
        midnight = datetime(now.year, now.month, now.day, tzinfo=UTC).timestamp() \
            + 86400
        assert abs(int(r.headers["retry-after"]) - (midnight - now.timestamp())) < 5
        # the operator sees it: the day's bucket, nearly spent, reset at midnight
        lim = httpx.get(f"{gw.url}/admin/limiter",
                        headers={"Authorization": "Bearer admin"}).json()
        (day,) = [b for b in lim["buckets"] if b["kind"] == "budget_daily"]
        assert day["scope"] == f"tenant:t@{now:%Y-%m-%d}" and day["limit"] == 0.05
        assert 0 < day["remaining"] < 0.04 and day["period_s"] is None
        assert abs(day["resets_in_s"] - (midnight - now.timestamp())) < 5
    finally:
        gw.close()


def _month_bucket(gw_url: str) -> dict[str, float]:
    lim = httpx.get(f"{gw_url}/admin/limiter", headers={"Authorization": "Bearer admin"}
                    ).json()
    (month,) = [b for b in lim["buckets"] if b["kind"] == "budget_monthly"]
    return month  # type: ignore[no-any-return]


def test_a_reload_changes_the_cap_never_the_spend(
        backend_factory: Callable[..., RunningBackend], tmp_path: Path) -> None:
    """Two replicas sharing Redis: what a tenant spent stays what it spent when its monthly
    budget is raised by hot reload (it was rescaled with the cap: $0.046 of $0.35 read as
    $4.67 of $5), and a budget lowered below the spend refuses the next request at once."""
    from redis_servers import RedisServer
    b = backend_factory()
    redis = RedisServer(tmp_path / "redis")
    path = tmp_path / "p.yaml"
    write_policy(path, _doc({"budget_monthly": 0.35}, f"{b.url}/v1"))
    gws = [start_gateway(path, redis_url=redis.url) for _ in range(2)]
    try:
        auth = {"Authorization": "Bearer key-t"}
        body = {"model": "m", "prompt": "hello " * 20, "max_tokens": 8}
        for gw in gws:
            assert httpx.post(f"{gw.url}/v1/completions", json=body, headers=auth,
                              timeout=30).status_code == 200
        spent = _month_bucket(gws[0].url)["used"]
        assert 0.01 < spent < 0.2
        for cap in (5.0, spent / 2, 5.0):
            write_policy(path, _doc({"budget_monthly": cap}, f"{b.url}/v1"))
            for gw in gws:
                deadline = time.monotonic() + 10
                while _month_bucket(gw.url)["limit"] != cap and time.monotonic() < deadline:
                    time.sleep(0.05)
                month = _month_bucket(gw.url)
                assert month["limit"] == cap
                if cap > spent:
                    assert month["used"] == pytest.approx(spent, rel=1e-6)
                    continue
                # lowered below what was spent: nothing left, refused at once, everywhere
                assert month["remaining"] == 0
                r = httpx.post(f"{gw.url}/v1/completions", json=body, headers=auth,
                               timeout=30)
                assert r.status_code == 429 and r.json()["error"]["code"] == "budget_exceeded"
    finally:
        for gw in gws:
            gw.close()
        redis.stop()
