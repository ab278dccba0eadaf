"""An upstream that misbehaves, on raw sockets: every malformed answer is an upstream failure
(retried before the first byte; an SSE error event and ``[DONE]`` after it), the endpoint is
counted as failed, the reservation is settled, the client gets OpenAI's shape with a status in
{4xx, 502, 503, 504}, and nothing of the upstream's text leaks."""

from __future__ import annotations

import ssl
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import openai
import pytest
import trustme
from gateway_stack import RunningGateway
from ledger import AUTH, charged, ledger_gateway, policy
from raw_upstream import (
    CLOSE,
    DONE,
    STREAM_HEAD,
    Answer,
    RawUpstream,
    Request,
    chunk,
    delta,
    json_response,
    usage_event,
)

from gateway.config.policy import PolicyError, parse_policy
from gateway.request.upstream import MAX_HEAD_BYTES

SECRET = "sk-live-SECRET-upstream-key"


def good(req: Request) -> Answer:
    """A well-behaved engine: the gateway always asks for a stream (a client that did not
    gets the answer built from it)."""
    assert req.json.get("stream") is True
    return [STREAM_HEAD, delta(0), delta(1), usage_event(5, 2), DONE]


@pytest.fixture
def upstreams() -> Iterator[Callable[[Callable[[Request], Answer]], RawUpstream]]:
    started: list[RawUpstream] = []

    def make(script: Callable[[Request], Answer], tls: ssl.SSLContext | None = None
             ) -> RawUpstream:
        u = RawUpstream(script, tls).start()
        started.append(u)
        return u

    yield make
    for u in started:
        u.close()


@pytest.fixture
def gateways(tmp_path: Path) -> Iterator[Callable[..., RunningGateway]]:
    started: list[RunningGateway] = []

    def make(urls: list[str], **kw: object) -> RunningGateway:
        gw = ledger_gateway(tmp_path, policy(urls, **kw))  # type: ignore[arg-type]
        started.append(gw)
        return gw

    yield make
    for gw in started:
        gw.close()


def chat(gw: RunningGateway, stream: bool = False, **kw: object) -> httpx.Response:
    return httpx.post(f"{gw.url}/v1/chat/completions", headers=AUTH, timeout=30, json={
        "model": "m", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4,
        "stream": stream, **kw})


def assert_openai_error(r: httpx.Response, statuses: set[int]) -> dict[str, object]:
    assert r.status_code in statuses, (r.status_code, r.text)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert SECRET not in r.text and "Traceback" not in r.text
    return err  # type: ignore[no-any-return]


BAD_HEADS: dict[str, Answer] = {
    "garbage status line": [b"HELLO THERE\r\n\r\n", CLOSE],
    "non-numeric status": [b"HTTP/1.1 abc OK\r\nContent-Length: 0\r\n\r\n", CLOSE],
    "status 600": [b"HTTP/1.1 600 Weird\r\nContent-Length: 2\r\n\r\n{}"],
    "bad content-length": [b"HTTP/1.1 200 OK\r\nContent-Length: zz\r\n\r\n{}", CLOSE],
    "two content-lengths": [b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 3"
                            b"\r\n\r\n{}", CLOSE],
    "endless head": [b"HTTP/1.1 200 OK\r\n" + b"X-Pad: " + b"a" * (MAX_HEAD_BYTES + 10)
                     + b"\r\n\r\n", CLOSE],
    "closed before a head": [CLOSE],
    "101 upgrade": [b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: h2c\r\n\r\n", CLOSE],
    "bad chunk size": [b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nZZ\r\n", CLOSE],
    "not a completion": [json_response(200, {"hello": SECRET})],
}


@pytest.mark.parametrize("case", sorted(BAD_HEADS))
def test_a_malformed_answer_before_the_first_byte_is_retried_elsewhere(
        case: str, upstreams: Callable[..., RawUpstream],
        gateways: Callable[..., RunningGateway]) -> None:
    bad = upstreams(lambda req: BAD_HEADS[case])
    fine = upstreams(good)
    gw = gateways([bad.url, fine.url])
    for _ in range(2):  # round robin: one of the two starts on the bad upstream
        r = chat(gw)
        assert r.status_code == 200, (case, r.text)
        assert r.json()["choices"][0]["message"]["content"] == "t0t1"
        assert r.headers["x-tokengate-endpoint"] == fine.url
    ep = gw.state.fleet.endpoints[bad.url]
    assert ep.health.failed >= 1, case
    # Alone, the same answer is a 502 in OpenAI's shape, and the reservation is returned.
    gw2 = gateways([bad.url])
    assert_openai_error(chat(gw2), {502})
    assert_openai_error(chat(gw2, stream=True), {502})
    assert charged(gw2) == (0.0, 0.0)


MID_STREAM: dict[str, list[bytes]] = {
    "bad chunk size": [b"QQ\r\nxx\r\n"],
    "chunk without its CRLF": [b"5\r\nhelloXX"],
    "event that is not JSON": [chunk(b"data: {not json\n\n")],
    "error event": [chunk(b'data: {"error": {"message": "' + SECRET.encode() + b'"}}\n\n')],
    "closed mid-chunk": [b"40\r\ndata: {"],
}


@pytest.mark.parametrize("case", sorted(MID_STREAM))
def test_a_stream_that_breaks_after_its_first_token_ends_with_an_error_event_and_done(
        case: str, upstreams: Callable[..., RawUpstream],
        gateways: Callable[..., RunningGateway]) -> None:
    bad = upstreams(lambda req: [STREAM_HEAD, delta(0), delta(1), *MID_STREAM[case], CLOSE])
    gw = gateways([bad.url])
    with httpx.stream("POST", f"{gw.url}/v1/chat/completions", headers=AUTH, timeout=30,
                      json={"model": "m", "messages": [{"role": "user", "content": "hello"}],
                            "max_tokens": 4, "stream": True}) as r:
        assert r.status_code == 200
        text = r.read().decode()
    assert SECRET not in text and "HTTP/1.1" not in text
    events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert '"code":"upstream_error"' in events[-2] or '"code": "upstream_error"' in events[-2]
    assert sum('"content":' in e for e in events) == 2
    # The gateway counts the endpoint's failure when its handler finishes, which can come
    # just after the client read the last byte: wait for it (briefly) rather than race it.
    health = gw.state.fleet.endpoints[bad.url].health
    deadline = time.monotonic() + 5.0
    while health.failed == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert health.failed == 1
    # Two tokens reached the client: they and the prompt are charged, nothing more.
    prompt = gw.state.view.counters["m"]
    tokens, requests = charged(gw)
    assert requests == 1.0
    assert tokens == pytest.approx(2 + _prompt_tokens(gw))
    assert prompt is not None


def _prompt_tokens(gw: RunningGateway) -> int:
    import asyncio

    counter = gw.state.view.counters["m"]
    fut = asyncio.run_coroutine_threadsafe(
        counter.chat([{"role": "user", "content": "hello"}]), gw.server.loop)
    return fut.result(10)


def test_an_interim_100_continue_is_skipped_and_trailers_are_parsed(
        upstreams: Callable[..., RawUpstream], gateways: Callable[..., RunningGateway]) -> None:
    def script(req: Request) -> Answer:
        head = STREAM_HEAD.replace(b"Transfer-Encoding: chunked\r\n",
                                   b"Transfer-Encoding: chunked\r\nTrailer: X-Done\r\n")
        return [b"HTTP/1.1 100 Continue\r\n\r\n", 0.05, head, delta(0), delta(1),
                usage_event(5, 2), chunk(b"data: [DONE]\n\n"), b"0\r\nX-Done: yes\r\n\r\n"]

    u = upstreams(script)
    gw = gateways([u.url])
    client = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="k", max_retries=0)
    stream = client.chat.completions.create(model="m", stream=True, max_tokens=4,
                                            messages=[{"role": "user", "content": "hello"}])
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == "t0t1"
    # The connection was read to its end: the next request reuses it.
    stream = client.chat.completions.create(model="m", stream=True, max_tokens=4,
                                            messages=[{"role": "user", "content": "hello"}])
    assert len([c for c in stream if c.choices]) == 2
    assert len(u.requests) == 2 and u.connections == 1
    assert gw.state.fleet.endpoints[u.url].health.failed == 0


@pytest.mark.parametrize("stream", [False, True])
def test_kept_alive_connections_are_reused(
        stream: bool, upstreams: Callable[..., RawUpstream],
        gateways: Callable[..., RunningGateway]) -> None:
    u = upstreams(good)
    gw = gateways([u.url])
    for _ in range(5):
        assert chat(gw, stream=stream).status_code == 200
    assert len(u.requests) == 5 and u.connections == 1
    # "Connection: close" from the upstream is honoured: the next request opens a new one.
    closing = upstreams(lambda req: [
        STREAM_HEAD.replace(b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n", 1), delta(0),
        usage_event(5, 1), DONE])
    gw2 = gateways([closing.url])
    for _ in range(3):
        assert chat(gw2).status_code == 200
    assert closing.connections == 3


@pytest.mark.parametrize(("status", "want"), [(400, 400), (422, 400), (401, 502), (403, 502),
                                              (404, 502), (418, 502), (302, 502), (201, 502)])
def test_an_upstream_error_body_never_reaches_the_client(
        status: int, want: int, upstreams: Callable[..., RawUpstream],
        gateways: Callable[..., RunningGateway]) -> None:
    body = {"error": {"message": f"Incorrect API key provided: {SECRET}", "type": "x",
                      "param": "messages", "code": "context_length_exceeded"}}
    u = upstreams(lambda req: [json_response(status, body, "Whatever")])
    gw = gateways([u.url])
    for stream in (False, True):
        err = assert_openai_error(chat(gw, stream=stream), {want})
        if want == 400:  # the request's own fault: its plain identifiers are kept
            assert err["code"] == "context_length_exceeded" and err["param"] == "messages"
            assert err["type"] == "invalid_request_error"
    # A 400 is the request's fault (not retried, the endpoint stays healthy); others count.
    failed = gw.state.fleet.endpoints[u.url].health.failed
    assert (failed == 0) if want == 400 else failed >= 2
    assert charged(gw) == (0.0, 0.0)


def test_https_upstream_verified_with_the_policy_ca(
        upstreams: Callable[..., RawUpstream], tmp_path: Path) -> None:
    ca = trustme.CA()
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(server_ctx)
    u = upstreams(good, server_ctx)
    ca_file = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    doc = policy([u.url])
    doc["models"]["m"]["endpoints"][0]["tls_ca_file"] = str(ca_file)
    gw = ledger_gateway(tmp_path, doc)
    try:
        client = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="k", max_retries=0)
        out = client.chat.completions.create(model="m", max_tokens=4,
                                             messages=[{"role": "user", "content": "hello"}])
        assert out.choices[0].message.content == "t0t1"
        stream = client.chat.completions.create(model="m", stream=True, max_tokens=4,
                                                messages=[{"role": "user", "content": "x"}])
        assert len([c for c in stream if c.choices]) == 2
    finally:
        gw.close()
    # Without the CA the certificate is refused: an upstream failure, not a 500.
    gw = ledger_gateway(tmp_path, policy([u.url]))
    try:
        assert_openai_error(chat(gw), {502})
        assert charged(gw) == (0.0, 0.0)
    finally:
        gw.close()


def test_userinfo_in_an_endpoint_url_is_refused() -> None:
    doc = policy(["http://user:pw@127.0.0.1:9/v1"])
    with pytest.raises(PolicyError, match="credentials in the URL"):
        parse_policy(doc)


def test_a_non_utf8_request_id_is_replaced_not_a_500(
        upstreams: Callable[..., RawUpstream], gateways: Callable[..., RunningGateway]) -> None:
    u = upstreams(good)
    gw = gateways([u.url])
    for rid in (b"\xff\xfe-bad", b"a b", b"ok-" + b"x" * 200):
        r = httpx.post(f"{gw.url}/v1/chat/completions",
                       headers=[(b"Authorization", b"Bearer k"), (b"X-Request-Id", rid)],
                       json={"model": "m", "messages": [{"role": "user", "content": "hello"}],
                             "max_tokens": 4}, timeout=30)
        assert r.status_code == 200, r.text
        assert r.headers["x-request-id"] != rid.decode("latin-1")
        sent = u.requests[-1].header("x-request-id")
        assert sent is not None and sent.isascii() and len(sent) == 32
    r = chat(gw, stream=False)
    assert r.status_code == 200


def test_a_hung_engine_costs_a_request_seconds_not_minutes(
        upstreams: Callable[..., RawUpstream],
        gateways: Callable[..., RunningGateway]) -> None:
    """One engine accepts every connection and never answers (its /metrics neither). Its
    scrapes fail and take it out within seconds; requests already waiting on it end then
    and are retried on the good engine: each is answered in seconds (the first-token
    timeout, 120 s by default, was the only bound)."""
    from raw_upstream import WAIT

    hung = upstreams(lambda req: [WAIT])
    ok = upstreams(good)
    gw = gateways([f"{hung.url}/v1", f"{ok.url}/v1"])
    c = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="k", max_retries=0, timeout=60)
    took = []
    for i in range(4):  # round robin: some land on the hung engine first
        t0 = time.monotonic()
        r = c.chat.completions.create(model="m", max_tokens=2,
                                      messages=[{"role": "user", "content": f"hi {i}"}])
        took.append(time.monotonic() - t0)
        assert r.choices[0].message.content == "t0t1"
    assert max(took) < 30, took  # within the scrapes' trip, far from 120 s
    assert any(q.head.startswith(b"POST") for q in hung.requests)
    hung.release()


def test_a_busy_engine_with_nowhere_else_to_go_is_waited_for(
        gateways: Callable[..., RunningGateway]) -> None:
    """The only engine is busy: its scrapes and health probe time out for seconds (a CPU
    engine loading an adapter), and it answers the request after 8 s. Its scrapes take it out
    of rotation, but with no other endpoint to retry on, the request waits for its answer
    (within the first-token timeout) rather than being cancelled into a 504."""
    up = RawUpstream(lambda req: [8.0, *good(req)],
                     scrapes=lambda req: [3.0, b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n"]
                     ).start()
    try:
        gw = gateways([up.url], model={"routing": {"strategy": "round_robin",
                                                   "scrape_interval_ms": 200}})
        trips: list[float] = []
        (ep,) = gw.state.fleet.endpoints.values()
        ep.health.on_trip.add(lambda: trips.append(time.monotonic()))
        c = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="k", max_retries=0, timeout=60)
        t0 = time.monotonic()
        r = c.chat.completions.create(model="m", max_tokens=2,
                                      messages=[{"role": "user", "content": "hi"}])
        assert r.choices[0].message.content == "t0t1"
        assert trips and trips[-1] > t0  # its scrapes took it out while the request waited
    finally:
        up.close()


def test_the_first_token_wait_follows_the_predicted_ttft() -> None:
    from gateway.config.resilience import Timeouts, first_token_wait

    t = Timeouts()
    assert first_token_wait(t, None) == 120.0  # nothing predicted: the cap
    assert first_token_wait(t, 0.05) == 10.0  # a short request: the floor
    assert first_token_wait(t, 3.0) == 30.0  # ten times the prediction
    assert first_token_wait(t, 20.0) == 120.0  # never past first_token_s
    assert first_token_wait(Timeouts(first_token_s=5.0), 3.0) == 5.0
