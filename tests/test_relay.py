"""The relay decides on parsed events: tokens counted however the JSON is spaced, in content,
reasoning and tool-call deltas; the model renamed in both spacings; error events and events
that are not JSON end the stream with our error event and [DONE]."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

from gateway.relay import RelayResult, relay_body, relay_stream
from gateway.upstream import UpstreamProtocolError


class Sink:
    def __init__(self) -> None:
        self.data = b""

    async def write(self, data: bytes) -> None:
        self.data += data


def chat_chunk(delta: dict[str, Any], *, spaced: bool, model: str = "up") -> bytes:
    obj = {"id": "c", "object": "chat.completion.chunk", "model": model,
           "choices": [{"index": 0, "delta": delta, "finish_reason": None}]}
    sep = (", ", ": ") if spaced else (",", ":")
    return b"data: " + json.dumps(obj, separators=sep).encode() + b"\n"


async def lines(*events: bytes) -> AsyncIterator[bytes]:
    for e in events:
        yield e
        yield b"\n"


async def relay(*events: bytes) -> tuple[RelayResult, str]:
    sink = Sink()
    res = await relay_stream(lines(*events), sink,  # type: ignore[arg-type]
                             upstream_model="up", served_model="served", pass_usage=False)
    return res, sink.data.decode()


@pytest.mark.parametrize("spaced", [False, True])
async def test_tokens_are_counted_in_every_kind_of_delta(spaced: bool) -> None:
    tool = {"tool_calls": [{"index": 0, "id": "t", "type": "function",
                            "function": {"name": "f", "arguments": "{\"a\""}}]}
    res, out = await relay(
        chat_chunk({"role": "assistant", "content": ""}, spaced=spaced),  # no token
        chat_chunk({"content": "Hi"}, spaced=spaced),
        chat_chunk({"reasoning_content": "hm"}, spaced=spaced),
        chat_chunk({"reasoning": "hm"}, spaced=spaced),
        chat_chunk(tool, spaced=spaced),
        chat_chunk({"tool_calls": [{"index": 0, "function": {"arguments": ""}}]},
                   spaced=spaced),  # no token
        b"data: [DONE]\n")
    assert res.chunks == 4 and res.first_token_at is not None and not res.broken
    assert '"up"' not in out and out.count('"served"') == 6
    assert out.endswith("data: [DONE]\n\n")


async def test_usage_is_read_and_dropped_unless_asked_however_spaced() -> None:
    usage = {"id": "c", "model": "up", "choices": [],
             "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}
    res, out = await relay(chat_chunk({"content": "x"}, spaced=True),
                           b"data: " + json.dumps(usage).encode() + b"\n", b"data: [DONE]\n")
    assert res.usage == usage["usage"] and res.done
    assert '"usage"' not in out


@pytest.mark.parametrize("bad", [b'data: {"error": {"message": "sk-live-123"}}\n',
                                 b"data: {not json\n", b"data: [1, 2]\n"])
async def test_an_error_or_malformed_event_ends_the_stream_with_ours(bad: bytes) -> None:
    res, out = await relay(chat_chunk({"content": "x"}, spaced=False), bad,
                           chat_chunk({"content": "never"}, spaced=False))
    assert res.broken and res.chunks == 1
    assert "sk-live" not in out and "never" not in out
    assert out.endswith('"code":"upstream_error"}}\n\ndata: [DONE]\n\n')


async def test_a_stream_that_ends_without_done_is_broken() -> None:
    res, out = await relay(chat_chunk({"content": "x"}, spaced=False))
    assert res.broken and out.endswith("data: [DONE]\n\n")


def test_a_body_is_renamed_and_must_be_a_completion() -> None:
    body = json.dumps({"id": "c", "model": "up", "choices": [{"text": "x"}],
                       "usage": {"prompt_tokens": 1, "completion_tokens": 1}},
                      separators=(", ", ": ")).encode()
    res = relay_body(body, upstream_model="up", served_model="served")
    assert res.body is not None and json.loads(res.body)["model"] == "served"
    assert res.usage == {"prompt_tokens": 1, "completion_tokens": 1}
    for bad in (b"not json", b"[]", b'{"error": {"message": "x"}}'):
        with pytest.raises(UpstreamProtocolError):
            relay_body(bad, upstream_model="up", served_model="served")
