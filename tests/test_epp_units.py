"""The EPP's pieces without Envoy: however Envoy cuts a response body into chunks, the relay
fed chunk by chunk (``LineFeed`` → ``relay_stream`` → ``Collected``) hands back exactly what
``tokengate serve``'s relay writes for the whole stream, with the same count and usage; the
proxy's subset and objective are read from where GIE's protocol puts them."""

from __future__ import annotations

import asyncio
import itertools

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st
from multidict import CIMultiDict, CIMultiDictProxy

from gateway.epp import messages
from gateway.epp.feed import Collected, LineFeed
from gateway.epp.proto import ext_proc_pb2 as pb
from gateway.request.relay import RelayResult, relay_stream


def sse(n: int) -> bytes:
    events = [{"id": "c1", "model": "up", "choices": [{"index": 0, "delta": {"content": f" t{i}"}}]}
              for i in range(n)]
    events.append({"id": "c1", "model": "up", "choices": [],
                   "usage": {"prompt_tokens": 7, "completion_tokens": n}})
    return b"".join(b"data: " + orjson.dumps(e) + b"\n\n" for e in events) + b"data: [DONE]\n\n"


async def whole(body: bytes) -> tuple[bytes, RelayResult]:
    async def lines():  # type: ignore[no-untyped-def]
        for line in body.splitlines(keepends=True):
            yield line

    sink = Collected()
    r = await relay_stream(lines(), sink, upstream_model="up", served_model="m", pass_usage=False)
    return sink.take(), r


async def chunked(body: bytes, cuts: list[int]) -> tuple[bytes, RelayResult]:
    feed, sink = LineFeed(), Collected()
    task = asyncio.ensure_future(relay_stream(feed, sink, upstream_model="up",
                                              served_model="m", pass_usage=False))
    out = b""
    bounds = [0, *sorted(set(cuts)), len(body)]
    for i, (a, b) in enumerate(itertools.pairwise(bounds)):
        feed.push(body[a:b], i == len(bounds) - 2)
        drained = asyncio.ensure_future(feed.drained.wait())
        await asyncio.wait((drained, task), return_when=asyncio.FIRST_COMPLETED)
        drained.cancel()
        out += sink.take()
    r = await task
    return out + sink.take(), r


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 12), data=st.data())
def test_any_chunking_relays_what_the_whole_stream_relays(n: int, data: st.DataObject) -> None:
    body = sse(n)
    cuts = data.draw(st.lists(st.integers(1, len(body) - 1), max_size=12))
    want, r0 = asyncio.run(whole(body))
    got, r1 = asyncio.run(chunked(body, cuts))
    assert got == want
    assert b'"model":"m"' in got and b'"usage"' not in got  # renamed; usage not asked for
    assert (r1.chunks, r1.usage, r1.done, r1.broken) == (r0.chunks, r0.usage, True, False) \
        and r1.chunks == n


def test_a_stream_cut_before_done_ends_with_our_error_event() -> None:
    body = sse(3)
    got, r = asyncio.run(chunked(body[: body.index(b"data: [DONE]")], [40]))
    assert r.broken and b'"code":"upstream_error"' in got and got.endswith(b"data: [DONE]\n\n")


def headers(**h: str) -> CIMultiDictProxy[str]:
    return CIMultiDictProxy(CIMultiDict(h))


def test_the_subset_comes_from_metadata_or_the_header() -> None:
    req = pb.ProcessingRequest()
    ns = req.metadata_context.filter_metadata[messages.SUBSET_NAMESPACE]
    ns.update({messages.SUBSET_HEADER: ["10.0.0.1:8000", "10.0.0.2:8000"]})
    assert messages.subset(req, headers()) == {"10.0.0.1:8000", "10.0.0.2:8000"}
    plain = pb.ProcessingRequest()
    client = headers(**{messages.SUBSET_HEADER: "a:1, b:2"})
    assert messages.subset(plain, client) is None  # a client's header: not by default
    assert messages.subset(plain, client, trust_header=True) == {"a:1", "b:2"}
    assert messages.subset(plain, headers(), trust_header=True) is None


def test_an_objective_names_the_priority_unless_one_is_given() -> None:
    h = messages.with_objective(headers(**{messages.OBJECTIVE: "flex"}))
    assert h["x-priority"] == "flex"
    h = messages.with_objective(headers(**{messages.OBJECTIVE: "flex", "x-priority": "critical"}))
    assert h["x-priority"] == "critical"


def test_immediate_errors_are_openai_shaped() -> None:
    from protocol.errors import APIError

    r = messages.error(APIError(429, "slow down", type="requests", code="rate_limit_exceeded",
                                headers={"retry-after": "2"}), {"x-request-id": "r1"})
    ir = r.immediate_response
    assert ir.status.code == 429
    assert orjson.loads(ir.body) == {"error": {"message": "slow down", "type": "requests",
                                               "param": None, "code": "rate_limit_exceeded"}}
    set_ = {h.header.key: h.header.raw_value for h in ir.headers.set_headers}
    assert set_["retry-after"] == b"2" and set_["x-request-id"] == b"r1"


@given(st.integers(0, 3 * messages.BODY_CHUNK_BYTES + 7), st.booleans(), st.booleans())
def test_a_body_goes_back_in_pieces_envoy_takes_and_only_the_last_ends_it(
        size: int, end: bool, response: bool) -> None:
    data = bytes(i % 251 for i in range(size))
    out = messages.body(data, end, response=response)
    which = "response_body" if response else "request_body"
    pieces = [getattr(r, which).response.body_mutation.streamed_response for r in out]
    assert all(r.WhichOneof("response") == which for r in out)
    assert b"".join(p.body for p in pieces) == data
    assert all(len(p.body) <= messages.BODY_CHUNK_BYTES for p in pieces)
    assert len(pieces) == max(1, -(-size // messages.BODY_CHUNK_BYTES))
    assert [p.end_of_stream for p in pieces] == [False] * (len(pieces) - 1) + [end]
