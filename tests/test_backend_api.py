"""The backend's OpenAI surface over loopback, driven by the official ``openai`` client."""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from collections.abc import Callable
from typing import Any

import httpx
import openai
import pytest
from conftest import RunningBackend

from protocol.tokenizer import Tokenizer

Factory = Callable[..., RunningBackend]


def client(b: RunningBackend, **kw: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{b.url}/v1", api_key="unused", max_retries=0, **kw)


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def post(url: str, body: bytes | dict[str, Any], headers: dict[str, str] | None = None
         ) -> httpx.Response:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(url, content=data, headers=headers or {}, timeout=30)


def assert_idle(b: RunningBackend) -> None:
    """Every KV block is back in the free queue and nothing is in flight."""
    deadline = time.monotonic() + 5
    while True:
        s = get_json(f"{b.url}/admin/state")
        kv = s["kv"]
        if kv["free_blocks"] == kv["num_gpu_blocks"] and s["in_flight"] == 0:
            return
        assert time.monotonic() < deadline, f"blocks not returned: {s}"
        time.sleep(0.02)


def test_chat_and_completions_with_the_openai_client(backend_factory: Factory,
                                                      tokenizer: Tokenizer) -> None:
    b = backend_factory()
    c = client(b)
    assert [m.id for m in c.models.list().data] == ["llama-3-8b"]
    r = c.chat.completions.create(model="llama-3-8b", max_tokens=20, seed=5,
                                  messages=[{"role": "user", "content": "Say something."}])
    text = r.choices[0].message.content or ""
    assert r.usage is not None and r.usage.completion_tokens == len(tokenizer.encode(text))
    assert r.usage.prompt_tokens == 3 + 1 + len(tokenizer.encode("Say something.")) + 3
    assert r.choices[0].finish_reason in ("stop", "length")
    again = c.chat.completions.create(model="llama-3-8b", max_tokens=20, seed=5,
                                      messages=[{"role": "user", "content": "Say something."}])
    assert again.choices[0].message.content == text  # same seed, same words
    # Exactly max_tokens with ignore_eos; the usage matches a re-tokenization of the text.
    r2 = c.completions.create(model="llama-3-8b", prompt=[1, 2, 3, 4], max_tokens=37,
                              extra_body={"ignore_eos": True, "no_stop_trim": True})
    assert r2.usage is not None and r2.usage.completion_tokens == 37
    assert len(tokenizer.encode(r2.choices[0].text)) == 37
    assert r2.choices[0].finish_reason == "length" and r2.usage.prompt_tokens == 4
    assert_idle(b)


def test_streaming_chunks_usage_and_done(backend_factory: Factory, tokenizer: Tokenizer) -> None:
    b = backend_factory()
    c = client(b)
    stream = c.chat.completions.create(
        model="llama-3-8b", stream=True, max_completion_tokens=12,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        messages=[{"role": "user", "content": "count"}])
    chunks = list(stream)
    content = [ch for ch in chunks if ch.choices and ch.choices[0].delta.content]
    assert len(content) == 12  # one chunk per token
    assert content[0].choices[0].delta.role == "assistant"
    assert chunks[-2].choices[0].finish_reason == "length"
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == 12 and not chunks[-1].choices
    text = "".join(ch.choices[0].delta.content or "" for ch in content)
    assert len(tokenizer.encode(text)) == 12
    # Without include_usage there is no usage chunk.
    plain = list(c.completions.create(model="llama-3-8b", prompt="hi", max_tokens=3,
                                      stream=True, extra_body={"ignore_eos": True}))
    assert all(ch.usage is None for ch in plain) and len(plain) == 3
    assert_idle(b)


def test_prefix_cache_hits_are_reported(backend_factory: Factory, tokenizer: Tokenizer) -> None:
    b = backend_factory()
    c = client(b)
    msgs = [{"role": "system", "content": "You are a careful assistant. " * 40},
            {"role": "user", "content": "first question"}]
    first = c.chat.completions.create(model="llama-3-8b", messages=msgs, max_tokens=2)
    assert first.usage and first.usage.prompt_tokens_details
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    second = c.chat.completions.create(model="llama-3-8b", max_tokens=2, messages=[
        msgs[0], {"role": "user", "content": "second question"}])
    assert second.usage and second.usage.prompt_tokens_details
    cached = second.usage.prompt_tokens_details.cached_tokens or 0
    a = tokenizer.chat_ids(msgs)
    b2 = tokenizer.chat_ids([msgs[0], {"role": "user", "content": "second question"}])
    common = next(i for i, (x, y) in enumerate(zip(a, b2, strict=False)) if x != y)
    assert cached == (common // 16) * 16 > 200  # whole shared blocks only
    metrics = httpx.get(f"{b.url}/metrics").text
    assert f"vllm:prefix_cache_hits_total{{engine=\"0\",model_name=\"llama-3-8b\"}} {cached}.0" \
        in metrics


def test_errors_use_openai_shape(backend_factory: Factory) -> None:
    b = backend_factory(max_body_bytes=4096, max_model_len=64)
    url = f"{b.url}/v1/chat/completions"

    def err(resp: httpx.Response, status: int) -> dict[str, Any]:
        assert resp.status_code == status, resp.text
        e = resp.json()["error"]
        assert set(e) == {"message", "type", "param", "code"}
        return dict(e)

    msgs = [{"role": "user", "content": "x"}]
    assert "JSON" in err(post(url, b"{not json"), 400)["message"]
    assert err(post(url, {"model": "nope", "messages": msgs}), 404)["code"] == "model_not_found"
    assert err(post(url, {"model": "llama-3-8b", "messages": msgs, "n": 200}), 400)["param"] == "n"
    image = [{"role": "user", "content": [{"type": "text", "text": "what is it?"}, {
        "type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]}]
    # a text-only model (no --image-tokens) refuses an image, naming the part
    assert err(post(url, {"model": "llama-3-8b", "messages": image}), 400)["param"] == \
        "messages[0].content[1]"
    assert err(post(url, {"model": "llama-3-8b", "messages": "hi"}), 400)["param"] == "messages"
    assert err(post(url, {"model": "llama-3-8b", "messages": msgs, "max_tokens": -1}),
               400)["param"] == "max_tokens"
    assert err(post(url, {"model": "llama-3-8b", "messages": msgs, "max_tokens": 100}),
               400)["code"] == "context_length_exceeded"
    assert err(post(url, {"model": "llama-3-8b", "messages": [
        {"role": "user", "content": "word " * 100}]}), 400)["code"] == "context_length_exceeded"
    assert err(post(url, b"{" + b" " * 5000 + b"}"), 413)["type"] == "invalid_request_error"
    assert err(httpx.get(f"{b.url}/v2/whatever"), 404)["type"] == "not_found_error"
    assert err(httpx.get(url), 405)
    ok = post(url, {"model": "llama-3-8b", "messages": msgs, "max_tokens": 2,
                    "skip_special_tokens": False, "some_router_field": {"a": 1}})
    assert ok.status_code == 200


def test_cold_start_health_answers_503_until_weights_load(backend_factory: Factory) -> None:
    # llama-3-8b is 16.06 GB: at 32 GB/s and time-scale 1 it loads for ~0.5 s.
    b = backend_factory(wait_ready=False, load_bandwidth_bps=32e9, time_scale=1.0)
    t0 = time.monotonic()
    assert httpx.get(f"{b.url}/health").status_code == 503
    r = post(f"{b.url}/v1/completions", {"model": "llama-3-8b", "prompt": "x"})
    assert r.status_code == 503 and r.json()["error"]["code"] == "model_loading"
    assert r.headers["retry-after"] == "1"
    while httpx.get(f"{b.url}/health").status_code != 200:
        time.sleep(0.01)
    assert 0.4 < time.monotonic() - t0 < 2.0


def test_admin_requests_gives_each_requests_times_on_the_hosts_clock(
        backend_factory: Factory) -> None:
    """``/admin/requests``: by ``X-Request-Id``, when the request reached the engine, its
    first token left it and it finished, on the host's monotonic clock (the client's too), in
    real seconds whatever ``--time-scale``."""
    b = backend_factory(time_scale=2.0)
    body = {"model": "llama-3-8b", "prompt": "x", "max_tokens": 5, "ignore_eos": True,
            "stream": True}
    sent = time.monotonic()
    first = None
    with httpx.stream("POST", f"{b.url}/v1/completions", json=body, timeout=30,
                      headers={"X-Request-Id": "timed-1"}) as r:
        for line in r.iter_lines():
            if first is None and line.startswith("data: {"):
                first = time.monotonic()
    done = time.monotonic()
    got = {x["id"]: x for x in get_json(f"{b.url}/admin/requests")["requests"]}
    t = got["timed-1"]
    assert first is not None
    assert sent <= t["arrival"] <= t["scheduled"] < t["first_token"] <= first
    assert t["first_token"] < t["finished"] <= done


def test_client_disconnect_frees_the_request(backend_factory: Factory) -> None:
    b = backend_factory(time_scale=1.0)
    body = {"model": "llama-3-8b", "prompt": "a long one", "max_tokens": 2000,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{b.url}/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        got = 0
        for line in lines:
            if line.startswith("data:"):
                got += 1
            if got == 3:
                break
        s = get_json(f"{b.url}/admin/state")
        assert s["in_flight"] == 1 and s["kv"]["free_blocks"] < s["kv"]["num_gpu_blocks"]
    assert_idle(b)
    # A non-streaming request whose client gives up is cancelled too.
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{b.url}/v1/completions", timeout=0.3,
                   json={**body, "stream": False})
    assert_idle(b)


def test_preemption_under_kv_pressure_completes_every_request(backend_factory: Factory) -> None:
    # Slow enough (~0.1 s a request) that the six always overlap, even on a loaded machine:
    # at a tiny time scale they could run one after another and never need to preempt.
    b = backend_factory(num_gpu_blocks=40, time_scale=0.1)
    c = client(b)
    results: list[int] = []
    start = threading.Barrier(6)

    def one(i: int) -> None:
        start.wait()
        r = c.completions.create(model="llama-3-8b", prompt=[i + 1] * 100, max_tokens=120,
                                 extra_body={"ignore_eos": True})
        assert r.usage is not None
        results.append(r.usage.completion_tokens)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results == [120] * 6
    metrics = httpx.get(f"{b.url}/metrics").text
    line = next(x for x in metrics.splitlines() if x.startswith("vllm:num_preemptions_total"))
    assert float(line.split()[-1]) > 0
    assert_idle(b)


def test_metrics_use_vllm_names(backend_factory: Factory) -> None:
    b = backend_factory(num_gpu_blocks=1000, block_size=32)
    client(b).completions.create(model="llama-3-8b", prompt="hello", max_tokens=3)
    text = httpx.get(f"{b.url}/metrics").text
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc",
                 "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
                 "vllm:num_preemptions_total", "vllm:prompt_tokens_total",
                 "vllm:generation_tokens_total", "vllm:time_to_first_token_seconds_bucket",
                 "vllm:inter_token_latency_seconds_bucket",
                 "vllm:e2e_request_latency_seconds_count", "vllm:request_success_total"):
        assert name in text, name
    info = next(x for x in text.splitlines() if x.startswith("vllm:cache_config_info{"))
    assert 'block_size="32"' in info and 'num_gpu_blocks="1000"' in info
    gen = next(x for x in text.splitlines() if x.startswith("vllm:generation_tokens_total"))
    assert gen.endswith(" 3.0")


def test_fault_injection(backend_factory: Factory) -> None:
    b = backend_factory(time_scale=0.01)
    c = client(b)
    r = post(f"{b.url}/admin/faults", {"error_rate": 1.0, "error_status": 429})
    assert r.json()["error_rate"] == 1.0
    with pytest.raises(openai.RateLimitError):
        c.completions.create(model="llama-3-8b", prompt="x", max_tokens=2)
    post(f"{b.url}/admin/faults", {"error_rate": 0.0, "drop_rate": 1.0, "drop_after_tokens": 2})
    with pytest.raises((httpx.RemoteProtocolError, openai.APIConnectionError)):
        list(c.completions.create(model="llama-3-8b", prompt="x", max_tokens=50, stream=True,
                                  extra_body={"ignore_eos": True}))
    assert_idle(b)
    post(f"{b.url}/admin/faults", {"drop_rate": 0.0, "stall_s": 0.3})
    t0 = time.monotonic()
    c.completions.create(model="llama-3-8b", prompt="x", max_tokens=1)
    assert time.monotonic() - t0 >= 0.3
    bad = post(f"{b.url}/admin/faults", {"error_rate": 2})
    assert bad.status_code == 400 and "error_rate" in bad.json()["error"]["message"]
    assert post(f"{b.url}/admin/faults", {"nonsense": 1}).status_code == 400


def test_api_key_guards_v1_and_admin(backend_factory: Factory) -> None:
    b = backend_factory(api_key="sekret")
    assert httpx.get(f"{b.url}/admin/state").status_code == 401
    with pytest.raises(openai.AuthenticationError):
        client(b).completions.create(model="llama-3-8b", prompt="x", max_tokens=1)
    ok = openai.OpenAI(base_url=f"{b.url}/v1", api_key="sekret")
    assert ok.completions.create(model="llama-3-8b", prompt="x", max_tokens=1).usage
    assert httpx.get(f"{b.url}/health").status_code == 200


def test_an_engine_failure_fails_requests_instead_of_hanging(backend_factory: Factory) -> None:
    b = backend_factory(time_scale=1.0)

    def boom(*_: object) -> float:
        raise RuntimeError("simulated bug in a step")

    # Break the engine from inside its own loop: the next step's timing raises.
    b.loop.call_soon_threadsafe(setattr, b.state.engine.timing, "step_seconds", boom)
    r = post(f"{b.url}/v1/completions", {"model": "llama-3-8b", "prompt": "x", "max_tokens": 5})
    assert r.status_code == 500 and r.json()["error"]["code"] == "engine_failed"
    assert httpx.get(f"{b.url}/health").status_code == 503
    r2 = post(f"{b.url}/v1/completions", {"model": "llama-3-8b", "prompt": "x"})
    assert r2.status_code == 503 and r2.json()["error"]["code"] == "engine_failed"


def test_a_body_that_is_not_what_its_encoding_says_is_a_400_not_a_500(
        backend_factory: Factory) -> None:
    b = backend_factory(served_model_name="m", time_scale=0.01)
    body = json.dumps({"model": "m", "prompt": "hi", "max_tokens": 1}).encode()
    for enc, status in (("gzip", 400), ("deflate", 400), ("x-nonsense", 415)):
        for path in ("/v1/completions", "/admin/faults"):
            r = httpx.post(f"{b.url}{path}", content=body,
                           headers={"Content-Encoding": enc, "Content-Type": "application/json"})
            assert r.status_code == status, (enc, path, r.text)
            assert set(r.json()["error"]) == {"message", "type", "param", "code"}
