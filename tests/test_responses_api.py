"""``POST /v1/responses`` through the gateway with the official ``openai`` client as the
application, on the reference backend: served statelessly as a chat completion, streamed and
not, with instructions, multi-item input (a function call and its output) and tools; the
prompt counted as the engine counts it; reserved and settled like chat; requests that need
server-side state, or built-in tools, refused in OpenAI's shape."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from conftest import RunningBackend
from gateway_stack import RunningGateway, client, one_tenant, serving, write_policy

TOOLS: list[Any] = [{"type": "function", "name": "get_weather",
                     "description": "The weather in a city.",
                     "parameters": {"type": "object",
                                    "properties": {"city": {"type": "string"}},
                                    "required": ["city"]}}]
TURNS: list[Any] = [
    {"role": "user", "content": "What is the weather in Paris and in Rome?"},
    {"type": "function_call", "call_id": "call_1", "name": "get_weather",
     "arguments": '{"city": "Paris"}'},
    {"type": "function_call", "call_id": "call_2", "name": "get_weather",
     "arguments": '{"city": "Rome"}'},
    {"type": "function_call_output", "call_id": "call_1", "output": "18 C, clear"},
    {"type": "function_call_output", "call_id": "call_2", "output": "24 C, cloudy"},
    {"role": "user", "content": [{"type": "input_text", "text": "And which is warmer?"}]}]


def spend_rows(gw: RunningGateway, want: Callable[[list[dict[str, Any]]], bool]
               ) -> list[dict[str, Any]]:
    """``/admin/spend`` by tenant once ``want`` holds (a request's record is written when it
    is settled, just after its answer ends)."""
    deadline = time.monotonic() + 10
    while True:
        rows: list[dict[str, Any]] = httpx.get(
            f"{gw.url}/admin/spend", params={"by": "tenant"}, timeout=10,
            headers={"Authorization": "Bearer admin-key"}).json()["rows"]
        if want(rows) or time.monotonic() > deadline:
            return rows
        time.sleep(0.05)


@pytest.fixture
def gw(backend_factory: Callable[..., RunningBackend], tmp_path: Path
       ) -> Iterator[RunningGateway]:
    b = backend_factory()
    doc = one_tenant({"m": {"endpoints": [{"url": f"{b.url}/v1"}],
                            "upstream_model": "llama-3-8b", "default_max_tokens": 16,
                            "price": {"input_per_1k": 1.0, "output_per_1k": 2.0}}},
                     {"limits": {"tpm": 100_000}})
    with serving(write_policy(tmp_path / "p.yaml", doc)) as g:
        yield g


@pytest.fixture
def c(gw: RunningGateway) -> Iterator[openai.OpenAI]:
    with client(gw) as cl:
        yield cl


def test_a_response_is_served_and_counted_as_the_engine_counts(c: openai.OpenAI) -> None:
    raw = c.responses.with_raw_response.create(
        model="m", instructions="Answer briefly.", input="Hello there", max_output_tokens=8,
        store=False)
    r = raw.parse()
    assert r.object == "response" and r.id.startswith("resp_") and r.model == "m"
    assert r.status in ("completed", "incomplete") and r.output_text
    assert r.usage is not None and r.usage.output_tokens <= 8
    # the gateway counted the prompt before sending it; the engine's count agrees
    assert int(raw.headers["x-tokengate-prompt-tokens"]) == r.usage.input_tokens
    chat = c.chat.completions.create(model="m", max_tokens=1, messages=[
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "Hello there"}])
    assert chat.usage is not None and chat.usage.prompt_tokens == r.usage.input_tokens


def test_a_streamed_response_has_the_typed_event_sequence(c: openai.OpenAI) -> None:
    events = list(c.responses.create(model="m", input="Tell me a story",
                                              max_output_tokens=12, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"], kinds
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done",
                            "response.output_item.done"], kinds
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response  # type: ignore[union-attr]
    assert deltas and final.output_text == deltas
    assert final.usage is not None and final.usage.output_tokens == 12
    assert final.usage.total_tokens == final.usage.input_tokens + 12


def test_tools_and_multi_item_input_are_counted_exactly(c: openai.OpenAI) -> None:
    """Five Responses requests with tools and function-call items: the gateway's count (its
    header) equals the engine's usage every time."""
    for n in range(5):
        raw = c.responses.with_raw_response.create(
            model="m", instructions="You are a weather bot." * (n + 1), input=TURNS[:n + 2],
            tools=TOOLS, tool_choice="auto", max_output_tokens=4)
        r = raw.parse()
        assert r.usage is not None
        assert int(raw.headers["x-tokengate-prompt-tokens"]) == r.usage.input_tokens, n


def test_the_quota_settles_what_a_response_used(gw: RunningGateway, c: openai.OpenAI) -> None:
    raw = c.responses.with_raw_response.create(model="m", input="count me",
                                               max_output_tokens=5)
    r = raw.parse()
    assert r.usage is not None
    rows = spend_rows(gw, lambda rows: bool(rows))
    assert rows[0]["prompt_tokens"] == r.usage.input_tokens
    assert rows[0]["completion_tokens"] == r.usage.output_tokens
    assert int(raw.headers["x-ratelimit-limit-tokens"]) == 100_000


@pytest.mark.parametrize(("kw", "param"), [
    ({"previous_response_id": "resp_123"}, "previous_response_id"),
    ({"store": True}, "store"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": [{"type": "file_search_call", "id": "x"}]}, "input[0].type"),
    ({"extra_body": {"frobnicate": 1}}, "frobnicate"),
])
def test_what_needs_server_state_or_builtin_tools_is_a_400(
        c: openai.OpenAI, kw: dict[str, Any], param: str) -> None:
    args: dict[str, Any] = {"model": "m", "input": "hi", **kw}
    with pytest.raises(openai.BadRequestError) as exc:
        c.responses.create(**args)
    err = exc.value.body
    assert isinstance(err, dict) and err["param"] == param, err
    assert err["type"] == "invalid_request_error" and err["message"]


def test_a_stream_that_breaks_ends_with_response_failed_and_settles_what_was_served(
        backend_factory: Callable[..., RunningBackend], tmp_path: Path) -> None:
    from backend.faults import FaultConfig

    b = backend_factory(faults=FaultConfig(drop_rate=1.0, drop_after_tokens=3))
    doc = one_tenant({"m": {"endpoints": [{"url": f"{b.url}/v1"}],
                            "upstream_model": "llama-3-8b"}}, {})
    doc["settings"]["retries"] = {"max_attempts": 1}
    with serving(write_policy(tmp_path / "p.yaml", doc)) as g, client(g) as c:
        events = list(c.responses.create(model="m", input="hi", max_output_tokens=20,
                                         stream=True))
        assert events[-1].type == "response.failed", [e.type for e in events]
        failed = events[-1].response  # type: ignore[union-attr]
        assert failed.status == "failed" and failed.error is not None
        assert failed.error.code == "upstream_error"
        assert sum(e.type == "response.output_text.delta" for e in events) == 3
        rows = spend_rows(g, lambda rows: bool(rows))
        assert rows[0]["completion_tokens"] == 3  # what the client was sent, no more
