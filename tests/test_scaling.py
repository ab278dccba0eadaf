"""Serverless scaling: token-velocity arithmetic, the replica target, the convertible-decoder
controller's decisions and hysteresis, and a pool that scales 0 -> 1 -> 0 with held requests."""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from gateway_stack import start_gateway, write_policy
from test_gateway_e2e import sha
from test_reliability import NOW, TPD, charged

from gateway.config.scaling import Scaling
from gateway.scaling.autoscaler import target_replicas
from gateway.scaling.conversions import Conversions, starting_prefill_eta_ms
from gateway.scaling.velocity import Capacity, DecayingRate, Velocity, profile_capacity


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_decaying_rate_converges_to_a_steady_rate_and_decays() -> None:
    clock = Clock()
    r = DecayingRate(tau_s=5.0, clock=clock)
    for _ in range(600):  # 200 tokens every 0.1 s = 2,000 tokens/s, for 60 s
        clock.t += 0.1
        r.add(200)
    assert r.rate() == pytest.approx(2000, rel=0.02)
    clock.t += 5.0  # one time constant without arrivals
    assert r.rate() == pytest.approx(2000 / 2.718281828, rel=0.02)
    # After a long idle, a step to 3,000 tokens/s reads at its size within two seconds
    # (bias-corrected; a plain decayed sum would read 1 - exp(-2 / 5) = 33 % of it).
    clock.t += 60.0
    for _ in range(20):
        clock.t += 0.1
        r.add(300)
    assert r.rate() == pytest.approx(3000, rel=0.1)
    # A meter that never saw an event reads zero.
    assert DecayingRate(clock=clock).rate() == 0.0


def test_velocity_turns_demand_into_replicas_per_role() -> None:
    clock = Clock()
    cap = Capacity(prefill=10_000, decode=1_000, transfer=100_000)
    agg = Velocity(cap, clock=clock)
    pd = Velocity(cap, disaggregated=True, clock=clock)
    for _ in range(1200):  # 12 requests/s of 2,000 prompt + 50 output tokens, for 100 s
        clock.t += 1 / 12
        agg.admitted(2000, 50)
        pd.admitted(2000, 50)
    # prefill 24,000 tok/s / (10,000 x 0.8) = 3.0; decode 600 / (1,000 x 0.8) = 0.75
    assert agg.rates()["prefill"] == pytest.approx(24_000, rel=0.02)
    assert agg.rates()["transfer"] == 0.0
    assert agg.desired(0.8) == {"both": 4}  # ceil(3.0 + 0.75)
    assert pd.desired(0.8) == {"prefill": 3 + (pd.needed("prefill", 0.8) > 3.0),
                               "decode": 1}
    # Convertible decoders: the decoder's spare quarter of its time prefills. With prefill at
    # 2.1 instances' worth, ceil(2.1 + 0.75) - 1 = 2 prefill instances instead of 3; at 2.5 the
    # spare time is not enough and it is 3 either way.
    def cap_for(n: float) -> float:
        return 24_000 / (n * 0.8)

    assert pd.desired(0.8, prefill_capacity=cap_for(2.1), convertible=True) == \
        {"prefill": 2, "decode": 1}
    assert pd.desired(0.8, prefill_capacity=cap_for(2.1)) == {"prefill": 3, "decode": 1}
    assert pd.desired(0.8, prefill_capacity=cap_for(2.5), convertible=True) == \
        {"prefill": 3, "decode": 1}
    # An observed prefill rate replaces the profile's.
    assert agg.desired(0.8, prefill_capacity=30_000)["both"] == 2  # 1.0 + 0.75
    c = profile_capacity("llama-3-8b", "h100-sxm")
    assert 10_000 < c.prefill < 100_000 and 1_000 < c.decode < 20_000
    assert c.transfer > c.prefill  # RDMA moves KV faster than a GPU computes it


@pytest.mark.parametrize("desired,held,idle,ready,expected", [
    (0, 0, 100.0, 1, 0),   # idle past the timeout: to zero
    (0, 0, 3.0, 1, 1),     # used recently: stay warm
    (0, 2, 100.0, 0, 1),   # requests held at zero: wake
    (7, 0, 0.0, 2, 4),     # capped at max_replicas
    (2, 0, 0.0, 2, 2),
])
def test_target_replicas(desired: int, held: int, idle: float, ready: int,
                         expected: int) -> None:
    s = Scaling(min_replicas=0, max_replicas=4, idle_timeout_s=30)
    assert target_replicas(s, desired, held=held, idle_s=idle, ready=ready) == expected
    warm = Scaling(min_replicas=1, max_replicas=4, idle_timeout_s=30)
    assert target_replicas(warm, 0, held=0, idle_s=1e9, ready=1) == 1


def test_conversion_controller_hysteresis() -> None:
    s = Scaling(convertible=True, ttft_slo_ms=1000, convert_backlog_ratio=1.0,
                revert_backlog_ratio=0.3, revert_after_s=5)
    c = Conversions()
    # A burst: the backlog passes the SLO and a cold start would not come in time.
    assert c.decide(1500, 0.0, s, decoders=3, warm_soon=False) == "convert"
    c.converted.append("d1")
    assert c.decide(1500, 0.5, s, decoders=2, warm_soon=False) == "convert"
    c.converted.append("d2")
    # The last one too: a converted decoder keeps decoding.
    assert c.decide(1500, 1.0, s, decoders=1, warm_soon=False) == "convert"
    c.converted.append("d3")
    assert c.decide(1500, 1.0, s, decoders=0, warm_soon=False) is None  # none left
    assert c.decide(1500, 1.0, s, decoders=3, warm_soon=True) is None  # capacity is coming
    # Between the marks: hold the conversions.
    assert [c.decide(600, t, s, decoders=1, warm_soon=False) for t in (2, 10, 20)] == \
        [None] * 3
    # Under the low mark: revert only after 5 s of calm, one at a time.
    assert c.decide(200, 30.0, s, decoders=1, warm_soon=False) is None
    assert c.decide(200, 33.0, s, decoders=1, warm_soon=False) is None
    assert c.decide(200, 35.0, s, decoders=1, warm_soon=False) == "revert"
    c.converted.pop()
    assert c.decide(200, 36.0, s, decoders=2, warm_soon=False) is None
    assert c.decide(900, 38.0, s, decoders=2, warm_soon=False) is None  # calm broken
    assert c.decide(200, 39.0, s, decoders=2, warm_soon=False) is None
    assert c.decide(200, 44.0, s, decoders=2, warm_soon=False) == "revert"


def test_prefill_capacity_starting_is_timed_from_the_last_cold_start() -> None:
    from gateway.scaling.launcher import Instance

    def inst(role: str, started: float, ready: float | None = None) -> Instance:
        return Instance(url="http://127.0.0.1:1/v1", proc=None,  # type: ignore[arg-type]
                        role=role, started_at=started, ready_at=ready)

    now = 100.0
    starting = [inst("decode", 99.0), inst("prefill", 95.0), inst("prefill", 98.0),
                inst("prefill", 90.0, ready=97.0)]
    # A 7 s cold start: the prefill launched at 95 s is due in 2 s; the decoder and the one
    # already ready do not count.
    assert starting_prefill_eta_ms(starting, 7.0, now) == pytest.approx(2000.0)
    assert starting_prefill_eta_ms(starting, None, now) == math.inf  # never measured
    assert starting_prefill_eta_ms([inst("decode", 99.0)], 7.0, now) == math.inf


def launched_pool(scaling: dict[str, Any], routing: dict[str, Any] | None = None
                  ) -> dict[str, Any]:
    """A policy whose model ``m`` (llama-3.2-1b reference backends at time scale 0.01) is a
    pool the gateway launches itself, with ``scaling`` (and ``routing``)."""
    m: dict[str, Any] = {"backend": {"model": "llama-3.2-1b", "hardware": "h200"},
                         "default_max_tokens": 4,
                         "scaling": {**scaling, "launcher": {"kind": "reference",
                                                             "time_scale": 0.01}}}
    if routing:
        m["routing"] = routing
    return {"version": 1, "settings": {"expose_endpoints": True}, "models": {"m": m},
            "tenants": {"t": {"keys": [{"sha256": sha("k")}]}},
            "routes": {"r": {"tenants": ["t"], "models": ["m"], "hold_timeout_ms": 60000}}}


def test_a_pool_scales_from_zero_and_back_with_held_requests(tmp_path: Path) -> None:
    doc = launched_pool({"min_replicas": 0, "max_replicas": 1, "idle_timeout_s": 2})
    gw = start_gateway(write_policy(tmp_path / "p.yaml", doc))
    scaler = gw.state.scalers["m"]
    try:
        time.sleep(0.5)
        assert scaler.instances == [] and not gw.state.view.pools["m"].endpoints  # at zero
        import concurrent.futures

        def ask() -> httpx.Response:
            return httpx.post(f"{gw.url}/v1/completions", headers={"Authorization": "Bearer k"},
                              json={"model": "m", "prompt": "hi", "max_tokens": 4},
                              timeout=60)

        t0 = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(3) as ex:
            answers = list(ex.map(lambda _: ask(), range(3)))  # all three held, then served
        cold = time.monotonic() - t0
        assert [r.status_code for r in answers] == [200] * 3
        assert scaler.started == 1 and len(scaler.instances) == 1
        proc = scaler.instances[0].proc
        metrics = httpx.get(f"{gw.url}/metrics").text
        assert 'tokengate_cold_starts_total{pool="m"} 1.0' in metrics
        assert 'tokengate_token_velocity_tokens_per_second{kind="demand",pool="m",' \
               'stage="prefill"}' in metrics
        # Idle past the timeout: drained and stopped, back to zero.
        deadline = time.monotonic() + 15
        while scaler.instances:
            assert time.monotonic() < deadline, "did not scale to zero"
            time.sleep(0.1)
        assert proc.poll() is not None and not gw.state.view.pools["m"].endpoints
        # ...and wakes again for the next request.
        assert ask().status_code == 200 and scaler.started == 2
        print(f"\ncold start with held requests: {cold:.2f} s")
    finally:
        gw.close()


def test_a_disaggregated_launcher_pool_starts_one_prefill_and_one_decode(tmp_path: Path
                                                                        ) -> None:
    doc = launched_pool({"min_replicas": 0, "max_replicas": 3, "disaggregated": True,
                         "idle_timeout_s": 60}, routing={"remote_prefill_min_tokens": 16})
    gw = start_gateway(write_policy(tmp_path / "p.yaml", doc))
    scaler = gw.state.scalers["m"]
    try:
        r = httpx.post(f"{gw.url}/v1/completions", headers={"Authorization": "Bearer k"},
                       json={"model": "m", "prompt": "hello there " * 100, "max_tokens": 4},
                       timeout=60)
        assert r.status_code == 200, r.text
        # One launch would have left a pool that cannot serve: both roles came up at once.
        assert sorted(i.role for i in scaler.instances) == ["decode", "prefill"]
        by_role = {i.role: i.url for i in scaler.instances}
        # The held request went as soon as the decoder was ready (it can compute the prompt
        # itself); once both are, a new prompt is prefilled on one and decoded on the other.
        deadline = time.monotonic() + 30
        while any(i.ready_at is None for i in scaler.instances):
            assert time.monotonic() < deadline, "an instance did not become ready"
            time.sleep(0.05)
        r = httpx.post(f"{gw.url}/v1/completions", headers={"Authorization": "Bearer k"},
                       json={"model": "m", "prompt": "good morning " * 100, "max_tokens": 4},
                       timeout=60)
        assert r.status_code == 200, r.text
        assert r.headers["x-tokengate-prefill-endpoint"] == by_role["prefill"]
        assert r.headers["x-tokengate-endpoint"] == by_role["decode"]
    finally:
        gw.close()


def test_a_stream_moves_off_a_drained_endpoint_without_the_client_noticing(
        backend_factory: object, tmp_path: Path) -> None:
    import openai

    from gateway.quota.limiter.memory import MemoryStore

    make = backend_factory  # type: ignore[assignment]
    a = make(served_model_name="m", time_scale=2.0)  # ~15 ms a token
    b = make(served_model_name="m", time_scale=2.0)
    doc = {"version": 1,
           "settings": {"admin_key_sha256": sha("adm"), "expose_endpoints": True},
           "models": {"m": {"endpoints": [{"url": f"{a.url}/v1"}, {"url": f"{b.url}/v1"}],
                            "routing": {"strategy": "round_robin"},
                            "scaling": {"min_replicas": 2, "max_replicas": 2}}},
           "tenants": {"t": {"keys": [{"sha256": sha("k")}], "limits": {"tpd": TPD}}},
           "routes": {"r": {"tenants": ["t"], "models": ["m"]}}}
    gw = start_gateway(write_policy(tmp_path / "p.yaml", doc))
    gw.state.store = MemoryStore(clock=lambda: NOW)  # frozen: it holds what was charged
    try:
        c = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="k", max_retries=0)
        for kind in ("chat", "completion"):
            before = charged(gw)
            if kind == "chat":
                raw = c.chat.completions.with_raw_response.create(
                    model="m", messages=[{"role": "user", "content": "tell me a story"}],
                    max_tokens=60, stream=True, stream_options={"include_usage": True},
                    extra_body={"ignore_eos": True})
            else:
                raw = c.completions.with_raw_response.create(
                    model="m", prompt="once upon a time", max_tokens=60, stream=True,
                    stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
            first = raw.headers["x-tokengate-endpoint"]
            other = f"{b.url}/v1" if first == f"{a.url}/v1" else f"{a.url}/v1"
            chunks = []
            for chunk in raw.parse():
                chunks.append(chunk)
                if len(chunks) == 10:  # mid-generation: drain the endpoint serving it
                    r = httpx.post(f"{gw.url}/admin/drain", json={"url": first},
                                   headers={"Authorization": "Bearer adm"})
                    assert r.json()["streams_moved"] == 1
            content = [ch for ch in chunks if ch.choices and (
                ch.choices[0].delta.content if kind == "chat" else ch.choices[0].text)]
            usage = chunks[-1].usage
            assert usage is not None
            assert len(content) == 60 and usage.completion_tokens == 60  # every token, once
            assert len({ch.id for ch in chunks}) == 1  # one stream, one id
            prompt_tokens = usage.prompt_tokens
            assert prompt_tokens < 30  # the original prompt, not prompt + generated text
            # Quota: charged once, for the prompt and the 60 tokens.
            assert charged(gw) - before == pytest.approx(prompt_tokens + 60, abs=1)
            # The rest came from the other endpoint; the drained one is out of rotation.
            fresh = httpx.post(f"{gw.url}/v1/completions", headers={"Authorization": "Bearer k"},
                               json={"model": "m", "prompt": "x", "max_tokens": 1})
            assert fresh.headers["x-tokengate-endpoint"] == other
            httpx.post(f"{gw.url}/admin/drain", json={"url": first, "undrain": True},
                       headers={"Authorization": "Bearer adm"})
        metrics = httpx.get(f"{gw.url}/metrics", headers={"Authorization": "Bearer adm"}).text
        assert 'tokengate_migrations_total{outcome="moved",pool="m"} 2.0' in metrics
    finally:
        gw.close()


def test_a_launcher_that_fails_backs_off_and_held_requests_get_503(tmp_path: Path) -> None:
    import sys

    doc = {"version": 1,
           "models": {"m": {"scaling": {"min_replicas": 0, "max_replicas": 2,
                                        "launcher": {"kind": "command", "command": [
                                            sys.executable, "-c", "import sys; sys.exit(3)",
                                            "{port}"]}}}},
           "tenants": {"t": {"keys": [{"sha256": sha("k")}]}},
           "routes": {"r": {"tenants": ["t"], "models": ["m"], "hold_timeout_ms": 3000}}}
    gw = start_gateway(write_policy(tmp_path / "p.yaml", doc))
    try:
        t0 = time.monotonic()
        r = httpx.post(f"{gw.url}/v1/completions", headers={"Authorization": "Bearer k"},
                       json={"model": "m", "prompt": "hi", "max_tokens": 2}, timeout=30)
        took = time.monotonic() - t0
        assert r.status_code == 503 and r.json()["error"]["code"] == "cold_start"
        assert r.headers["retry-after"] == "2" and 2.9 < took < 5
        # Launches back off (1 s, 2 s, ...) instead of one every 0.25 s tick.
        assert 1 <= gw.state.scalers["m"].started <= 3
    finally:
        gw.close()
