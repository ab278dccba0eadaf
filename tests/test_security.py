"""What must not get through the gateway, and what must not leak out of it.

A recording upstream (a real HTTP server) shows exactly what reached it; ``schemathesis`` tests
the gateway against its own OpenAPI document."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import schemathesis
from gateway_stack import RunningGateway, start_gateway, write_policy
from hypothesis import HealthCheck, settings
from recording_upstream import RecordingUpstream
from schemathesis.specs.openapi.checks import ignored_auth, missing_required_header
from test_gateway_e2e import sha

from gateway.front.openapi import document

UPSTREAM_SECRET = "upstream-secret-9f8e7d"


@pytest.fixture(scope="module")
def upstream() -> Iterator[RecordingUpstream]:
    rec = RecordingUpstream().start()
    yield rec
    rec.close()


@pytest.fixture(scope="module")
def gw(upstream: RecordingUpstream, tmp_path_factory: pytest.TempPathFactory
       ) -> Iterator[RunningGateway]:
    mp = pytest.MonkeyPatch()
    mp.setenv("TG_TEST_UPSTREAM_KEY", UPSTREAM_SECRET)
    doc = {"version": 1,
           "settings": {"admin_key_sha256": sha("admin"), "max_body_bytes": 65536,
                        "max_messages": 16,
                        "client": {"header_timeout_s": 0.5, "body_timeout_s": 0.5}},
           "models": {"m": {"endpoints": [{"url": upstream.url,
                                           "api_key_env": "TG_TEST_UPSTREAM_KEY"}],
                            "default_max_tokens": 8},
                      "m2": {"endpoints": [{"url": upstream.url}]}},
           "tenants": {"t1": {"keys": [{"sha256": sha("k1")}]},
                       "t2": {"keys": [{"sha256": sha("k2")}]}},
           "routes": {"r1": {"tenants": ["t1"], "models": ["m"]},
                      "r2": {"tenants": ["t2"], "models": ["m2"]}}}
    g = start_gateway(write_policy(tmp_path_factory.mktemp("sec") / "p.yaml", doc))
    yield g
    g.close()
    mp.undo()


def is_openai_error(r: httpx.Response) -> bool:
    try:
        err = r.json()["error"]
    except (ValueError, KeyError, TypeError):
        return False
    return set(err) == {"message", "type", "param", "code"} and "Traceback" not in r.text


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def test_unauthorized_requests_never_reach_the_upstream(gw: RunningGateway,
                                                        upstream: RecordingUpstream) -> None:
    before = len(upstream.requests)
    cases: list[tuple[dict[str, str], dict[str, Any], int]] = [
        ({}, CHAT, 401),
        ({"Authorization": "Bearer nope"}, CHAT, 401),
        ({"Authorization": "Bearer"}, CHAT, 401),
        ({"Authorization": "Basic azE6"}, CHAT, 401),
        ({"Authorization": "Bearer k2"}, CHAT, 404),  # m is t1's model, not t2's
        ({"Authorization": "Bearer k1"}, {**CHAT, "model": "m2"}, 404),
        ({"Authorization": "Bearer k1"}, {**CHAT, "model": "gpt-4o"}, 404),
    ]
    for headers, body, status in cases:
        r = httpx.post(f"{gw.url}/v1/chat/completions", json=body, headers=headers)
        assert r.status_code == status and is_openai_error(r), (headers, body, r.text)
    for path in ("/admin/policy", "/admin/endpoints", "/admin/limiter", "/admin/predictor"):
        for headers in ({}, {"Authorization": "Bearer k1"}, {"Authorization": "Bearer adm"}):
            r = httpx.get(f"{gw.url}{path}", headers=headers)
            assert r.status_code == 401 and is_openai_error(r)
    assert httpx.get(f"{gw.url}/admin/policy",
                     headers={"Authorization": "Bearer admin"}).status_code == 200
    r = httpx.get(f"{gw.url}/v1/models", headers={"Authorization": "Bearer k2"})
    assert [m["id"] for m in r.json()["data"]] == ["m2"]
    assert len(upstream.requests) == before  # nothing was forwarded
    r = httpx.post(f"{gw.url}/v1/chat/completions", json=CHAT,
                   headers={"Authorization": "Bearer k1"})
    assert r.status_code == 200 and len(upstream.requests) == before + 1


def test_nothing_sensitive_crosses_the_gateway(gw: RunningGateway,
                                               upstream: RecordingUpstream) -> None:
    client_headers = {"Proxy-Authorization": "Basic c2VjcmV0", "Cookie": "session=abc",
                      "X-Forwarded-For": "10.1.2.3", "TE": "trailers", "Upgrade": "h2c",
                      "Connection": "keep-alive, Upgrade", "Keep-Alive": "timeout=5",
                      "X-Custom-Client": "leak-me"}
    c = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="k1", max_retries=0,
                      default_headers=client_headers)
    for stream in (False, True):
        before = len(upstream.requests)
        raw = c.chat.completions.with_raw_response.create(
            model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=3,
            stream=stream)
        text = raw.http_response.read().decode()
        seen = upstream.requests[before]
        got = {k.lower(): v for k, v in seen.headers.items()}
        assert got["authorization"] == f"Bearer {UPSTREAM_SECRET}"
        assert set(got) <= {"host", "content-length", "content-type", "x-request-id",
                            "authorization"}, got
        assert "k1" not in "".join(got.values())
        response_text = text + "".join(f"{k}: {v}" for k, v in raw.headers.items())
        for secret in (UPSTREAM_SECRET, "internal.example", "secret-engine"):
            assert secret not in response_text
        assert raw.headers["x-request-id"] == got["x-request-id"]


def test_admin_lists_its_routes_to_the_admin_only(gw: RunningGateway) -> None:
    """``GET /admin`` is the index of the admin routes, behind the admin key like them; every
    route it lists answers the admin (none 404s), and the OpenAPI document has each."""
    assert httpx.get(f"{gw.url}/admin", timeout=10).status_code == 401
    assert httpx.get(f"{gw.url}/admin", headers={"Authorization": "Bearer k1"},
                     timeout=10).status_code == 401
    got = httpx.get(f"{gw.url}/admin", headers={"Authorization": "Bearer admin"}, timeout=10)
    assert got.status_code == 200
    routes = got.json()["routes"]
    paths = {r["path"] for r in routes}
    assert {"/admin", "/admin/policy", "/admin/endpoints", "/admin/limiter", "/admin/spend",
            "/admin/flow", "/admin/predictor", "/admin/scaling", "/admin/drain"} == paths
    assert all(r["description"] and r["method"] in ("GET", "POST") for r in routes)
    spec = httpx.get(f"{gw.url}/openapi.json", timeout=10).json()["paths"]
    for r in routes:
        assert r["method"].lower() in spec[r["path"]], r
        if r["method"] == "GET":
            answer = httpx.get(f"{gw.url}{r['path']}", timeout=10,
                               headers={"Authorization": "Bearer admin"})
            assert answer.status_code == 200, (r, answer.text[:200])


def test_the_engines_address_is_told_only_to_the_admin(gw: RunningGateway,
                                                       upstream: RecordingUpstream) -> None:
    """No ``x-tokengate-endpoint`` for a tenant by default (settings.expose_endpoints); a
    request that carries the admin key in ``x-tokengate-admin-key`` sees it, and that key
    goes no further than the gateway."""
    def ask(extra: dict[str, str]) -> httpx.Response:
        return httpx.post(f"{gw.url}/v1/chat/completions", timeout=30,
                          headers={"Authorization": "Bearer k1", **extra},
                          json={"model": "m", "max_tokens": 3,
                                "messages": [{"role": "user", "content": "hi"}]})

    plain = ask({})
    assert plain.status_code == 200 and "x-tokengate-endpoint" not in plain.headers
    assert "x-tokengate-endpoint" not in ask({"x-tokengate-admin-key": "wrong"}).headers
    before = len(upstream.requests)
    admin = ask({"x-tokengate-admin-key": "admin"})
    assert admin.headers["x-tokengate-endpoint"] == upstream.url
    seen = {k.lower() for k in upstream.requests[before].headers}
    assert "x-tokengate-admin-key" not in seen


def test_oversized_and_malformed_requests_are_refused_early(
        gw: RunningGateway, upstream: RecordingUpstream) -> None:
    before = len(upstream.requests)
    auth = {"Authorization": "Bearer k1", "Content-Type": "application/json"}
    big = b'{"model":"m","messages":[{"role":"user","content":"' + b"x" * 70000 + b'"}]}'
    deep = b'{"model":"m","messages":' + b"[" * 5000 + b"]" * 5000 + b"}"
    many = {**CHAT, "messages": [{"role": "user", "content": "x"}] * 17}
    for body, status in ((big, 413), (deep, 400), (httpx.Request("POST", "/", json=many).read(),
                                                    400), (b"\xff\xfe", 400)):
        r = httpx.post(f"{gw.url}/v1/chat/completions", content=body, headers=auth)
        assert r.status_code == status and is_openai_error(r), r.text[:200]
    flood = {**auth, **{f"X-Flood-{i}": "y" for i in range(200)}}
    r = httpx.post(f"{gw.url}/v1/chat/completions", json=CHAT, headers=flood)
    assert r.status_code == 400 and is_openai_error(r), r.text[:200]
    r = httpx.post(f"{gw.url}/v1/chat/completions", json=CHAT,
                   headers={**auth, "X-Huge": "z" * 20000})
    assert r.status_code in (400, 431) and is_openai_error(r), r.text[:200]
    assert len(upstream.requests) == before


def _raw_exchange(url: str, data: bytes, wait_s: float) -> tuple[bytes, float]:
    """Send ``data`` and then nothing; what comes back before the server closes, and when."""
    host, port = url.removeprefix("http://").split(":")
    t0 = time.monotonic()
    with socket.create_connection((host, int(port)), timeout=wait_s) as s:
        s.sendall(data)
        out = b""
        while True:
            try:
                piece = s.recv(65536)
            except TimeoutError:
                break
            if not piece:
                break
            out += piece
    return out, time.monotonic() - t0


def test_slow_senders_are_cut_off(gw: RunningGateway) -> None:
    """header_timeout_s and body_timeout_s are 0.5 s in this policy."""
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer k1\r\n"
    for partial in (b"", head, head + b"Content-Type: application/json\r\n"
                    b"Content-Length: 200\r\n\r\n{\"model\":"):
        out, took = _raw_exchange(gw.url, partial, wait_s=5)
        assert out.startswith(b"HTTP/1.1 408"), out[:200]
        assert b'"code":"request_timeout"' in out and 0.4 < took < 3, (out, took)


schema = schemathesis.openapi.from_dict(document(max_messages=16))  # as the policy says


@schema.parametrize()
@settings(max_examples=15, deadline=None,
          suppress_health_check=list(HealthCheck))
def test_the_gateway_honours_its_openapi_document(case: Any, gw: RunningGateway) -> None:
    """Generated requests (valid and not) for every documented operation: never a 5xx, every
    error in OpenAI's shape, every response as documented."""
    # Generated framing headers (content-length: garbage) test the HTTP parser, not the API;
    # malformed framing has its own tests above.
    framing = {"content-length", "transfer-encoding", "host", "connection", "expect"}
    case.headers = {k: v for k, v in (case.headers or {}).items() if k.lower() not in framing}
    case.headers["Authorization"] = "Bearer k1"
    if case.path.startswith("/admin/") or case.path == "/metrics":
        case.headers["Authorization"] = "Bearer admin"
    r = case.call(base_url=gw.url, timeout=10)
    assert r.status_code < 500, r.text[:300]
    if r.status_code >= 400:
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    # The key is always set here (auth has its own test above), so schemathesis's checks
    # that drop the Authorization header would be misled by it.
    case.validate_response(r, excluded_checks=[missing_required_header, ignored_auth])


def test_the_document_is_served(gw: RunningGateway) -> None:
    r = httpx.get(f"{gw.url}/openapi.json")
    assert r.status_code == 200 and r.json() == document(max_messages=16)


def test_policy_settings_are_strict(tmp_path: Path) -> None:
    from gateway.config.policy import PolicyError, parse_policy

    base = {"version": 1, "models": {"m": {"endpoints": [{"url": "http://x/v1"}]}},
            "tenants": {}, "routes": {}}
    with pytest.raises(PolicyError, match=r"settings\.client\.header_timeout"):
        parse_policy({**base, "settings": {"client": {"header_timeout": 1}}})
    with pytest.raises(PolicyError, match=r"settings\.retries\.max_attempts"):
        parse_policy({**base, "settings": {"retries": {"max_attempts": 0}}})
    p = parse_policy({**base, "settings": {"timeouts": {"first_token_s": 9}},
                      "tenants": {"t": {"keys": [{"sha256": sha("k")}]}},
                      "routes": {"r": {"tenants": ["t"], "models": ["m"],
                                       "timeouts": {"between_tokens_s": 2}}}})
    t = p.routes["r"].timeouts
    assert (t.first_token_s, t.between_tokens_s, t.total_s) == (9, 2, 600)


def test_a_clients_kv_transfer_params_never_reach_the_upstream(
        gw: RunningGateway, upstream: RecordingUpstream) -> None:
    """Only the gateway may set kv_transfer_params: a client's would make a decode engine
    pull KV from an address the client names (SSRF)."""
    evil = {"do_remote_prefill": True, "remote_host": "10.9.8.7", "remote_port": 6379,
            "remote_engine_id": "x", "remote_request_id": "y", "remote_block_ids": [1]}
    for stream in (False, True):
        before = len(upstream.requests)
        r = httpx.post(f"{gw.url}/v1/chat/completions", headers={"Authorization": "Bearer k1"},
                       json={**CHAT, "stream": stream, "kv_transfer_params": evil})
        assert r.status_code == 200, r.text
        body = upstream.requests[before].body
        assert "kv_transfer_params" not in body and body["messages"] == CHAT["messages"]


def test_the_backend_pulls_kv_only_from_peers_it_trusts(backend_factory: Any) -> None:
    """A request naming a prefill peer outside the backend's --kv-peer networks (loopback by
    default) is refused with 400, and the peer is never contacted."""
    contacted: list[bool] = []
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    listener.settimeout(0.5)
    port = listener.getsockname()[1]
    b = backend_factory(served_model_name="m", time_scale=0.01, kv_peers=("10.0.0.0/8",))
    try:
        for host in ("127.0.0.1", "169.254.169.254", "example.com"):
            kv = {"do_remote_prefill": True, "remote_host": host, "remote_port": port,
                  "remote_engine_id": "e", "remote_request_id": "r", "remote_block_ids": [0]}
            r = httpx.post(f"{b.url}/v1/completions", json={
                "model": "m", "prompt": "hello " * 40, "max_tokens": 2,
                "kv_transfer_params": kv})
            assert r.status_code == 400 and r.json()["error"]["code"] == "kv_peer_not_allowed"
        try:
            listener.accept()
            contacted.append(True)
        except TimeoutError:
            pass
        assert not contacted
    finally:
        listener.close()


@pytest.mark.parametrize("scheme", ["bearer", "BEARER", "Bearer", "bEaReR"])
def test_the_bearer_scheme_is_case_insensitive(gw: RunningGateway, scheme: str) -> None:
    r = httpx.post(f"{gw.url}/v1/chat/completions", json=CHAT,
                   headers={"Authorization": f"{scheme} k1"})
    assert r.status_code == 200, r.text


def test_a_body_that_is_not_what_its_encoding_says_is_a_400(gw: RunningGateway) -> None:
    import json

    for enc in ("gzip", "deflate", "br", "x-nonsense"):
        r = httpx.post(f"{gw.url}/v1/chat/completions", content=json.dumps(CHAT).encode(),
                       headers={"Authorization": "Bearer k1", "Content-Encoding": enc,
                                "Content-Type": "application/json"})
        assert r.status_code in (400, 415) and is_openai_error(r), (enc, r.status_code, r.text)


def test_responses_do_not_say_what_the_gateway_runs_on(gw: RunningGateway) -> None:
    responses = [httpx.post(f"{gw.url}/v1/chat/completions", json=CHAT,
                            headers={"Authorization": "Bearer k1"}),
                 httpx.post(f"{gw.url}/v1/chat/completions", json=CHAT),
                 httpx.get(f"{gw.url}/nowhere"), httpx.get(f"{gw.url}/health")]
    for r in responses:
        server = r.headers.get("server", "")
        assert "aiohttp" not in server.lower() and "python" not in server.lower(), server


def test_metrics_are_behind_the_admin_key_and_may_name_no_tenant(
        tmp_path: Path, upstream: RecordingUpstream) -> None:
    doc: dict[str, Any] = {
        "version": 1, "settings": {"admin_key_sha256": sha("admin")},
        "models": {"m": {"endpoints": [{"url": upstream.url}]}},
        "tenants": {"acme-secret-customer": {"keys": [{"sha256": sha("k1")}]}},
        "routes": {"r": {"tenants": ["acme-secret-customer"], "models": ["m"]}}}
    g = start_gateway(write_policy(tmp_path / "p.yaml", doc))
    try:
        assert httpx.post(f"{g.url}/v1/chat/completions", json=CHAT,
                          headers={"Authorization": "Bearer k1"}).status_code == 200
        anonymous = httpx.get(f"{g.url}/metrics")
        assert anonymous.status_code == 401 and is_openai_error(anonymous)
        assert "acme-secret-customer" not in anonymous.text
        admin = httpx.get(f"{g.url}/metrics", headers={"Authorization": "Bearer admin"})
        assert admin.status_code == 200 and 'tenant="acme-secret-customer"' in admin.text
    finally:
        g.close()
    doc["settings"] = {"public_metrics": True, "metrics_tenant_label": False}
    g = start_gateway(write_policy(tmp_path / "q.yaml", doc))
    try:
        assert httpx.post(f"{g.url}/v1/chat/completions", json=CHAT,
                          headers={"Authorization": "Bearer k1"}).status_code == 200
        time.sleep(0.2)
        text = httpx.get(f"{g.url}/metrics").text
        assert 'tenant="*"' in text and "acme-secret-customer" not in text
    finally:
        g.close()
