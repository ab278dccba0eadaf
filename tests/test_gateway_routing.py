"""The routing brain end to end: reference backends on loopback behind the gateway, the
official ``openai`` client in front."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from conftest import RunningBackend
from gateway_stack import RunningGateway, start_gateway, write_policy
from test_backend_pd import metric
from test_gateway_e2e import sha

from backend.events import KVEventsConfig
from protocol.loopback import free_port

Factory = Callable[..., RunningBackend]
LONG = "The quick brown fox jumps over the lazy dog. " * 60  # ~600 tokens


def doc(endpoints: list[dict[str, Any]], routing: dict[str, Any] | None = None,
        route: dict[str, Any] | None = None, small: str | None = None) -> dict[str, Any]:
    models: dict[str, Any] = {"big": {"endpoints": endpoints, "upstream_model": "llama-3-8b",
                                      "backend": {"model": "llama-3-8b"},
                                      "routing": {"block_size": 16, **(routing or {})}}}
    if small:
        models["big"]["fallback"] = ["small"]
        models["small"] = {"endpoints": [{"url": small}], "upstream_model": "llama-3.2-1b"}
    return {"version": 1,
            "settings": {"admin_key_sha256": sha("admin-key"), "expose_endpoints": True},
            "models": models,
            "tenants": {"a": {"keys": [{"sha256": sha("key-a")}], "limits": {"tpm": 1e6},
                              "max_priority": "critical"},
                        "f": {"keys": [{"sha256": sha("key-f")}], "priority": "flex"}},
            "routes": {"r": {"tenants": ["a", "f"], "models": list(models), **(route or {})}}}


def gateway(tmp_path: Path, d: dict[str, Any]) -> RunningGateway:
    return start_gateway(write_policy(tmp_path / "policy.yaml", d))


def client(gw: RunningGateway, key: str = "key-a") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gw.url}/v1", api_key=key, max_retries=0)


def stream(c: openai.OpenAI, prompt: str = LONG, max_tokens: int = 8,
           headers: dict[str, str] | None = None) -> tuple[dict[str, str], Any]:
    raw = c.completions.with_raw_response.create(
        model="big", prompt=prompt, max_tokens=max_tokens, stream=True,
        stream_options={"include_usage": True}, extra_headers=headers or {},
        extra_body={"ignore_eos": True})
    chunks = list(raw.parse())
    return dict(raw.headers), chunks


def test_prefill_decode_pool_end_to_end(backend_factory: Factory, tmp_path: Path) -> None:
    p = backend_factory(role="prefill", served_model_name="llama-3-8b")
    d = backend_factory(role="decode", served_model_name="llama-3-8b")
    gw = gateway(tmp_path, doc([{"url": f"{p.url}/v1", "role": "prefill"},
                                {"url": f"{d.url}/v1", "role": "decode"}],
                               {"remote_prefill_min_tokens": 64}))
    try:
        headers, chunks = stream(client(gw))
        usage = chunks[-1].usage
        assert usage is not None and usage.completion_tokens == 8
        assert headers["x-tokengate-prefill-endpoint"] == f"{p.url}/v1"
        assert headers["x-tokengate-endpoint"] == f"{d.url}/v1"
        assert float(headers["x-tokengate-predicted-ttft-ms"]) > 0
        assert float(headers["x-tokengate-predicted-tpot-ms"]) > 0
        # The protocol: prefill computed the prompt, decode pulled it and computed one token.
        assert metric(p, "vllm:prompt_tokens_total") == usage.prompt_tokens
        assert metric(d, "tokengate_backend_kv_transfer_tokens_total") == usage.prompt_tokens
        assert metric(d, "vllm:prompt_tokens_total") == 1
        # The prefill endpoint's queue moved on when its prompt was computed, and the TTFT
        # the predictor learns from runs from the prefill's start, as the client sees it.
        pe = gw.state.fleet.endpoints[f"{p.url}/v1"]
        deadline = time.monotonic() + 5
        while not pe.live.recent_ttft_ms and time.monotonic() < deadline:
            time.sleep(0.01)
        assert pe.live.head_done_at > 0 and not pe.live.pending and pe.live.prefill_tokens == 0
        assert pe.live.recent_ttft_ms / 1e3 >= metric(p, "vllm:e2e_request_latency_seconds_sum")
        # Both steps count in quota once, as one request.
        gm = httpx.get(f"{gw.url}/metrics", headers={"Authorization": "Bearer admin-key"}).text
        assert 'tokengate_prompt_tokens_total{model="big",tenant="a"} ' \
            f'{float(usage.prompt_tokens)}' in gm
        assert 'tokengate_requests_total{model="big",route="r",status="200",tenant="a"} 1.0' in gm
        # Same prompt again: decode now caches it, so no remote prefill.
        headers2, _ = stream(client(gw))
        assert "x-tokengate-prefill-endpoint" not in headers2
        assert headers2["x-tokengate-endpoint"] == f"{d.url}/v1"
    finally:
        gw.close()


def test_failed_prefill_decodes_alone(backend_factory: Factory, tmp_path: Path) -> None:
    p = backend_factory(role="prefill", served_model_name="llama-3-8b")
    d = backend_factory(role="decode", served_model_name="llama-3-8b")
    httpx.post(f"{p.url}/admin/faults", json={"error_rate": 1.0, "error_status": 500})
    gw = gateway(tmp_path, doc([{"url": f"{p.url}/v1", "role": "prefill"},
                                {"url": f"{d.url}/v1", "role": "decode"}]))
    try:
        headers, chunks = stream(client(gw))
        assert chunks[-1].usage.completion_tokens == 8
        assert "x-tokengate-prefill-endpoint" not in headers
        assert metric(d, "vllm:prompt_tokens_total") == chunks[-1].usage.prompt_tokens
    finally:
        gw.close()


@pytest.mark.parametrize("index", ["approximate", "precise"])
def test_prefix_affinity_follows_the_cache(backend_factory: Factory, tmp_path: Path,
                                           index: str) -> None:
    events = [KVEventsConfig(f"tcp://127.0.0.1:{free_port()}",
                             f"tcp://127.0.0.1:{free_port()}") for _ in range(3)]
    eps = [{"kv_events": {"endpoint": ev.endpoint, "replay": ev.replay_endpoint}}
           for ev in events]
    bs = [backend_factory(served_model_name="llama-3-8b",
                          kv_events=ev if index == "precise" else None) for ev in events]
    gw = gateway(tmp_path, doc([{"url": f"{b.url}/v1", **ep} for b, ep in zip(bs, eps,
                                                                            strict=True)],
                               {"strategy": "prefix", "index": index, "seed": 3}))
    try:
        c = client(gw)
        prompts = [f"Document {i}: " + LONG for i in range(3)]
        first = {}
        for pr in prompts:
            first[pr] = stream(c, pr)[0]["x-tokengate-endpoint"]
            if index == "precise":
                _wait_indexed(gw, first[pr])
        for _ in range(2):
            for pr in prompts:
                assert stream(c, pr + " And a follow-up question?")[0][
                    "x-tokengate-endpoint"] == first[pr]
        hits = sum(metric(b, "vllm:prefix_cache_hits_total") for b in bs)
        assert hits >= 6 * 500  # every follow-up found its document cached
        if index == "precise":
            # The index holds what the engines report, in the gateway's own hashes.
            def both() -> list[tuple[int, int]]:
                rows = httpx.get(f"{gw.url}/admin/endpoints", headers={
                    "Authorization": "Bearer admin-key"}).json()["big"]["endpoints"]
                return [(r["index_blocks"], sum(1 for blk in b.state.engine.pool.blocks
                                                if blk.block_hash is not None))
                        for b, r in zip(bs, rows, strict=True)]
            deadline = time.monotonic() + 5
            while any(a != b for a, b in both()) and time.monotonic() < deadline:
                time.sleep(0.05)
            pairs = both()
            assert all(a == b for a, b in pairs) and sum(b for _, b in pairs) > 0, pairs
    finally:
        gw.close()


def _wait_indexed(gw: RunningGateway, url: str, timeout_s: float = 10.0) -> None:
    """Until the gateway's precise index holds blocks for endpoint ``url``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        rows = httpx.get(f"{gw.url}/admin/endpoints", headers={
            "Authorization": "Bearer admin-key"}).json()["big"]["endpoints"]
        if any(r["url"] == url and r["index_blocks"] > 0 for r in rows):
            return
        time.sleep(0.05)
    raise AssertionError(f"no KV events from {url} reached the index")


def test_slo_fallback_flex_shedding_and_bad_headers(backend_factory: Factory,
                                                   tmp_path: Path) -> None:
    big = backend_factory(served_model_name="llama-3-8b")
    small = backend_factory(model="llama-3.2-1b", served_model_name="llama-3.2-1b")
    gw = gateway(tmp_path, doc([{"url": f"{big.url}/v1"}], route={"on_slo_miss": "fallback",
                                                                  "queue_ms": 100},
                               small=f"{small.url}/v1"))
    try:
        c = client(gw)
        # Nobody can answer in 0.01 ms: the route says fail over to the fallback model.
        headers, chunks = stream(c, headers={"x-slo-ttft-ms": "0.01"})
        assert headers["x-tokengate-failover"] == "slo"
        assert headers["x-tokengate-model"] == "small" and chunks[0].model == "small"
        # Critical requests (a band tenant a was granted) are never diverted or shed.
        headers, _ = stream(c, headers={"x-slo-ttft-ms": "0.01", "x-priority": "critical"})
        assert headers["x-tokengate-model"] == "big"
        # Flex (here by tenant) waits up to queue_ms, then is shed with 503 and retry-after.
        with pytest.raises(openai.InternalServerError) as err:
            stream(client(gw, "key-f"), headers={"x-slo-ttft-ms": "0.01"})
        assert err.value.status_code == 503
        assert err.value.response.headers["retry-after"] == "2"
        assert err.value.body["code"] == "overloaded"  # type: ignore[index]
        # A flex request with room to spare is served.
        headers, _ = stream(client(gw, "key-f"))
        assert headers["x-tokengate-model"] == "big"
        for name, value in (("x-priority", "urgent"), ("x-slo-ttft-ms", "soon"),
                            ("x-slo-tpot-ms", "-5")):
            r = httpx.post(f"{gw.url}/v1/completions", headers={
                "Authorization": "Bearer key-a", name: value},
                json={"model": "big", "prompt": "hi", "max_tokens": 2})
            assert r.status_code == 400, (name, r.text)
            assert r.json()["error"]["param"] == name
        gm = httpx.get(f"{gw.url}/metrics", headers={"Authorization": "Bearer admin-key"}).text
        assert 'tokengate_failovers_total{from_model="big",reason="slo",to_model="small"}' in gm
        assert 'action="shed"' in gm
    finally:
        gw.close()


def test_predictor_learns_online_and_reports_its_error(backend_factory: Factory,
                                                       tmp_path: Path) -> None:
    bs = [backend_factory(served_model_name="llama-3-8b") for _ in range(2)]
    gw = gateway(tmp_path, doc([{"url": f"{b.url}/v1"} for b in bs]))
    gw.state.predictor.config.min_samples = 20
    gw.state.predictor.config.retrain_s = 0.2
    try:
        c = client(gw)
        for i in range(30):
            stream(c, f"{i} " + LONG[: 40 * (1 + i % 10)], max_tokens=8)
        deadline = time.monotonic() + 10
        while gw.state.predictor.models is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert gw.state.predictor.source.startswith("xgboost-v")
        stream(c, "after training " + LONG, max_tokens=8)
        # Over the context the engines report (their /v1/models max_model_len): refused
        # before anything is reserved or routed, in OpenAI's words.
        with pytest.raises(openai.BadRequestError) as err:
            stream(c, LONG * 16, max_tokens=4)
        assert err.value.code == "context_length_exceeded"
        assert "maximum context length is" in err.value.message
        gm = httpx.get(f"{gw.url}/metrics", headers={"Authorization": "Bearer admin-key"}).text
        assert 'tokengate_predictor_mape{target="ttft"}' in gm
        assert 'tokengate_predictor_mape{target="tpot"}' in gm
        trained = [float(x.split()[-1]) for x in gm.splitlines()
                   if x.startswith("tokengate_predictor_trainings_total")]
        assert trained and trained[0] >= 1
        summary = httpx.get(f"{gw.url}/admin/predictor",
                            headers={"Authorization": "Bearer admin-key"}).json()
        assert summary["error"]["ttft"]["n"] >= 30 and summary["samples"]["ttft"] >= 30
        eps = httpx.get(f"{gw.url}/admin/endpoints",
                        headers={"Authorization": "Bearer admin-key"}).json()["big"]
        assert eps["strategy"] == "predicted"
        for e in eps["endpoints"]:  # every live counter is back to zero
            assert e["block_size"] == 16
            assert (e["in_flight"], e["prefill_tokens"], e["decoding"]) == (0, 0, 0), e
        assert sum(e["routed"] for e in eps["endpoints"]) == 31  # not the refused one
    finally:
        gw.close()


def test_the_approximate_index_learns_only_from_requests_the_engine_accepted(
        backend_factory: Factory, tmp_path: Path) -> None:
    """Requests the engine refuses (over its context: the policy claims a longer one, so the
    gateway lets them through) leave no blocks in the approximate index; one it serves
    leaves exactly its prompt's full blocks."""
    b = backend_factory(served_model_name="llama-3-8b", max_model_len=1024)
    d = doc([{"url": f"{b.url}/v1"}], {"strategy": "prefix"})
    d["models"]["big"]["max_context"] = 100_000
    gw = gateway(tmp_path, d)
    try:
        c = client(gw)
        for i in range(5):
            with pytest.raises(openai.BadRequestError):
                stream(c, f"Refused {i}: " + LONG * 3)
        assert gw.state.fleet.approx.size(f"{b.url}/v1") == 0
        stream(c, "Served: " + LONG)
        assert gw.state.fleet.approx.size(f"{b.url}/v1") == len(
            b.state.tokenizer.encode("Served: " + LONG)) // 16
    finally:
        gw.close()


@pytest.mark.parametrize("caching", [True, False])
def test_an_engine_without_a_prefix_cache_gets_no_prefix_index(
        backend_factory: Factory, tmp_path: Path, caching: bool) -> None:
    """An engine whose ``cache_config_info`` says it keeps no prefix cache (vLLM: an embedding
    model with bidirectional attention, or ``--no-enable-prefix-caching``) has nothing for
    prefix affinity to find: its prompts are neither hashed nor recorded. With the cache on,
    the same request records its prompt's full blocks."""
    b = backend_factory(served_model_name="llama-3-8b", enable_prefix_caching=caching)
    gw = gateway(tmp_path, doc([{"url": f"{b.url}/v1"}], {"strategy": "prefix"}))
    try:
        ep = gw.state.fleet.endpoints[f"{b.url}/v1"]
        deadline = time.monotonic() + 10
        while ep.engine.prefix_caching is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert ep.engine.prefix_caching is caching
        stream(client(gw), "Served: " + LONG)
        blocks = len(b.state.tokenizer.encode("Served: " + LONG)) // 16
        assert gw.state.fleet.approx.size(f"{b.url}/v1") == (blocks if caching else 0)
    finally:
        gw.close()


def test_a_prefill_naming_a_host_outside_the_pool_is_not_passed_to_decode(
        tmp_path: Path) -> None:
    """A "prefill" pod answers kv_transfer_params that point the decode engine at another
    host: they never reach decode (it computes the prompt itself), and it is counted."""
    from raw_upstream import (
        DONE,
        STREAM_HEAD,
        Answer,
        RawUpstream,
        Request,
        delta,
        json_response,
        usage_event,
    )

    def prefill(req: Request) -> Answer:
        if not req.head.startswith(b"POST"):
            return [b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n"]
        return [json_response(200, {
            "id": "p", "object": "text_completion", "model": "llama-3-8b",
            "choices": [{"index": 0, "text": "x", "finish_reason": "length"}],
            "usage": {"prompt_tokens": 300, "completion_tokens": 1, "total_tokens": 301},
            "kv_transfer_params": {"do_remote_prefill": True, "remote_host": "10.66.66.66",
                                   "remote_port": 5600, "remote_engine_id": "e",
                                   "remote_block_ids": [1, 2]}})]

    def decode(req: Request) -> Answer:
        if not req.head.startswith(b"POST"):
            return [b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n"]
        return [STREAM_HEAD, delta(0, "text"), usage_event(300, 1), DONE]

    p, d = RawUpstream(prefill).start(), RawUpstream(decode).start()
    gw = gateway(tmp_path, doc([{"url": f"{p.url}/v1", "role": "prefill"},
                                {"url": f"{d.url}/v1", "role": "decode"}],
                               {"remote_prefill_min_tokens": 64}))
    try:
        r = client(gw).completions.create(model="big", prompt=LONG, max_tokens=1)
        assert r.choices[0].text == "t0"
        assert any(q.head.startswith(b"POST") for q in p.requests)  # it was asked
        sent = [q.json for q in d.requests if q.head.startswith(b"POST")]
        assert sent and "kv_transfer_params" not in sent[-1]
        gm = httpx.get(f"{gw.url}/metrics", headers={"Authorization": "Bearer admin-key"}).text
        assert 'tokengate_prefill_rejected_total{model="big"} 1.0' in gm
    finally:
        gw.close()
        p.close()
        d.close()
