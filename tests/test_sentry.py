"""The cost sentry with a looping agent: the same request again and again is stopped after the
limit, a session over its dollar cap is stopped exactly even across two replicas sharing a real
Redis, and a session spending far faster than its tenant's other sessions is throttled; each
stop is an OpenAI-shaped 429, a metric and an audit line."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from conftest import RunningBackend
from gateway_stack import start_gateway, write_policy
from redis_servers import RedisServer
from test_gateway_e2e import sha

from gateway.config.sentry import SentryConfig
from gateway.metrics import GatewayMetrics
from gateway.spend.sentry import Sentry

ADMIN = {"Authorization": "Bearer admin-key"}


def doc(url: str, **sentry: Any) -> dict[str, Any]:
    return {"version": 1, "settings": {"admin_key_sha256": sha("admin-key"),
                                       "sentry": sentry, "spend": {"log": False}},
            "models": {"m": {"endpoints": [{"url": url}], "upstream_model": "llama-3-8b",
                             "default_max_tokens": 4,
                             "price": {"input_per_1k": 1.0, "output_per_1k": 2.0}}},
            "tenants": {"t": {"keys": [{"sha256": sha("key-t")}]}},
            "routes": {"r": {"tenants": ["t"], "models": ["m"]}}}


def send(url: str, session: str, prompt: str = "do the next step") -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", timeout=30, json={
        "model": "m", "prompt": prompt, "max_tokens": 4}, headers={
        "Authorization": "Bearer key-t", "x-fairness-id": session})


def test_a_looping_agent_is_stopped_after_the_repeat_limit(
        backend_factory: Callable[..., RunningBackend], tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    b = backend_factory()
    gw = start_gateway(write_policy(tmp_path / "p.yaml", doc(f"{b.url}/v1", repeat_limit=3)))
    caplog.set_level(logging.WARNING, logger="tokengate.sentry")
    try:
        codes = [send(gw.url, "agent-1").status_code for _ in range(3)]
        assert codes == [200, 200, 200]
        stopped = send(gw.url, "agent-1")
        assert stopped.status_code == 429 and int(stopped.headers["retry-after"]) == 600
        err = stopped.json()["error"]
        assert err["type"] == "runaway" and err["code"] == "repeated_prompt"
        assert set(err) == {"message", "type", "param", "code"}
        assert send(gw.url, "agent-1", "a different step").status_code == 200
        assert send(gw.url, "agent-2").status_code == 200  # another session is not stopped
        assert any("agent-1" in r.getMessage() for r in caplog.records
                   if r.name == "tokengate.sentry")
        text = httpx.get(f"{gw.url}/metrics", headers=ADMIN).text
        assert 'tokengate_sentry_actions_total{reason="repeated_prompt",tenant="t"} 1.0' in text
    finally:
        gw.close()


def test_a_session_cap_holds_exactly_across_two_replicas(
        backend_factory: Callable[..., RunningBackend], tmp_path: Path) -> None:
    b = backend_factory()
    redis = RedisServer(tmp_path / "redis")
    path = write_policy(tmp_path / "p.yaml", doc(f"{b.url}/v1", session_budget=0.05))
    one, two = start_gateway(path, redis_url=redis.url), start_gateway(path, redis_url=redis.url)
    try:
        spent, served = 0.0, []
        for i in range(10):  # ~$0.013 a request: the cap stops the session within the loop
            r = send((one, two)[i % 2].url, "loop", f"step {i} " * 5)
            if r.status_code != 200:
                break
            u = r.json()["usage"]
            spent += u["prompt_tokens"] * 1e-3 + u["completion_tokens"] * 2e-3
            served.append(i)
        assert r.status_code == 429 and r.json()["error"]["code"] == "session_budget_exceeded"
        assert r.json()["error"]["type"] == "runaway"
        assert 0.05 - 0.02 < spent <= 0.05 + 1e-9, spent  # never over the cap, on both
        assert len(served) >= 2 and {i % 2 for i in served} == {0, 1}
        assert send(one.url, "fresh").status_code == 200  # a new session starts afresh
    finally:
        one.close()
        two.close()
        redis.stop()


def test_a_session_spending_far_faster_than_usual_is_throttled() -> None:
    cfg = SentryConfig(velocity_factor=5.0, velocity_window_s=60.0)
    s = Sentry(GatewayMetrics())
    for k in range(10):  # ten sessions over the last hour, $0.01 each every 6 minutes
        for j in range(10):
            s.spent("t", f"t/s{k}", 0.01, 360.0 * j + k)
    now = 3600.0
    assert s.check(cfg, "t", "t/agent", b"x", now) is None
    for j in range(20):  # the agent: $0.05 a second for 20 s
        s.spent("t", "t/agent", 0.05, now + j)
    err = s.check(cfg, "t", "t/agent", b"y", now + 20)
    assert err is not None and err.status == 429 and err.code == "spend_velocity"
    assert s.check(cfg, "t", "t/s1", b"z", now + 20) is None  # the others go on
    assert s.check(cfg, "t", None, b"z", now + 20) is None  # no session: nothing to judge


def test_idle_sessions_are_forgotten() -> None:
    """Session ids are the clients': the sentry keeps only those active within its windows."""
    cfg = SentryConfig(repeat_limit=3, repeat_window_s=600.0)
    s = Sentry(GatewayMetrics())
    for i in range(3000):
        assert s.check(cfg, "t", f"t/s{i}", b"x", float(i)) is None
    # every SWEEP_EVERY checks, sessions idle past the windows go: the last 600 s stay
    assert len(s.sessions) <= 600 + 1024
    assert "t/s2999" in s.sessions and "t/s0" not in s.sessions


def test_the_same_request_spaced_or_reordered_is_still_a_repeat() -> None:
    """The repeat detector compares requests as canonical JSON: trailing spaces, other key
    orders or spacing (each a different byte string) do not make a looping agent new."""
    cfg = SentryConfig(repeat_limit=2, repeat_window_s=600.0)
    s = Sentry(GatewayMetrics())
    same = [orjson.loads(b'{"model": "m", "messages": [{"role": "user", "content": "go"}]}  '),
            orjson.loads(b'{"messages":[{"content":"go","role":"user"}],"model":"m"}')]
    assert s.check(cfg, "t", "t/a", same[0], 1.0) is None
    assert s.check(cfg, "t", "t/a", same[1], 2.0) is None
    err = s.check(cfg, "t", "t/a", {"model": "m", "messages": [
        {"role": "user", "content": "go"}]}, 3.0)
    assert err is not None and err.code == "repeated_prompt"
    assert s.check(cfg, "t", "t/a", {"model": "m", "messages": [
        {"role": "user", "content": "go on"}]}, 4.0) is None
