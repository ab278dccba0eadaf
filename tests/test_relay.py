"""The relay decides on parsed events: tokens counted however the JSON is spaced, in content,
reasoning and tool-call deltas; the model renamed in both spacings; error events and events
that are not JSON end the stream with our error event and [DONE]."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

from gateway.request.aggregate import Aggregate
from gateway.request.relay import RelayResult, relay_stream


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


async def _lines(data: bytes) -> AsyncIterator[bytes]:
    """A body's lines, each with its newline (as ``UpstreamResponse.lines`` gives them)."""
    for line in data.splitlines(keepends=True):
        yield line


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


def _chat(delta: dict[str, object], **extra: object) -> bytes:
    obj = {"id": "c", "object": "chat.completion.chunk", "created": 7, "model": "up",
           "choices": [{"index": 0, "delta": delta, "finish_reason": None, **extra}]}
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


async def test_an_answer_is_built_from_a_stream_as_openai_answers_it() -> None:
    """Content, reasoning, tool calls merged by index, logprobs and the finish reason; the
    model renamed; the engine's usage."""
    lp = {"content": [{"token": "a", "logprob": -0.1}]}
    events = [
        _chat({"role": "assistant", "content": ""}),
        _chat({"reasoning_content": "think "}), _chat({"reasoning_content": "more"}),
        _chat({"content": "He"}, logprobs=lp), _chat({"content": "llo"}, logprobs=lp),
        _chat({"tool_calls": [{"index": 0, "id": "call_a", "type": "function",
                               "function": {"name": "get", "arguments": '{"ci'}}]}),
        _chat({"tool_calls": [{"index": 1, "id": "call_b", "type": "function",
                               "function": {"name": "put", "arguments": "{}"}}]}),
        _chat({"tool_calls": [{"index": 0, "function": {"arguments": 'ty": 1}'}}]}),
        _chat({}, finish_reason="tool_calls"),
        b'data: {"id": "c", "model": "up", "choices": [], "usage": {"prompt_tokens": 3, '
        b'"completion_tokens": 9, "total_tokens": 12}}\n\n',
        b"data: [DONE]\n\n"]
    agg = Aggregate("chat")
    res = await relay_stream(_lines(b"".join(events)), agg, upstream_model="up",
                             served_model="served", pass_usage=True)
    assert not res.broken and res.chunks == 7
    out = json.loads(agg.body(usage={}))
    assert out["object"] == "chat.completion" and out["model"] == "served"
    assert (out["id"], out["created"]) == ("c", 7)
    msg = out["choices"][0]["message"]
    assert msg["content"] == "Hello" and msg["reasoning_content"] == "think more"
    assert msg["tool_calls"] == [
        {"id": "call_a", "type": "function", "function": {"name": "get",
                                                          "arguments": '{"city": 1}'}},
        {"id": "call_b", "type": "function", "function": {"name": "put", "arguments": "{}"}}]
    assert out["choices"][0]["logprobs"] == {"content": lp["content"] * 2}
    assert out["choices"][0]["finish_reason"] == "tool_calls"
    assert out["usage"]["completion_tokens"] == 9


async def test_a_completion_is_built_with_the_gateways_usage_when_none_came() -> None:
    events = [b'data: {"id": "t", "object": "text_completion", "model": "up", "choices": '
              b'[{"index": 0, "text": "' + w + b'", "finish_reason": ' + f + b"}]}\n\n"
              for w, f in ((b"a", b"null"), (b" b", b'"length"'))] + [b"data: [DONE]\n\n"]
    agg = Aggregate("completion")
    res = await relay_stream(_lines(b"".join(events)), agg, upstream_model="up",
                             served_model="up", pass_usage=True)
    out = json.loads(agg.body(usage={"prompt_tokens": 1, "completion_tokens": res.chunks,
                                     "total_tokens": 1 + res.chunks}))
    assert out["object"] == "text_completion"
    assert out["choices"] == [{"index": 0, "text": "a b", "logprobs": None,
                               "finish_reason": "length"}]
    assert out["usage"]["completion_tokens"] == 2
    assert res.texts == ["a", " b"]
