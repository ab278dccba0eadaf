"""Prefill/decode handoff between two instances, convertible roles, and KV events."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import msgpack
import openai
import zmq
from conftest import RunningBackend, start_backend
from test_backend_api import assert_idle, get_json, post

from backend.events import KVEventsConfig
from protocol.loopback import free_port
from protocol.tokenizer import Tokenizer

Factory = Callable[..., RunningBackend]
PROMPT = "The quick brown fox jumps over the lazy dog. " * 30  # 300 tokens


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """What a NixlConnector proxy sends to the prefill instance."""
    out = {k: v for k, v in body.items() if k not in ("stream_options", "min_tokens")}
    out.update(stream=False, max_tokens=1, kv_transfer_params={
        "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
        "remote_block_ids": None, "remote_host": None, "remote_port": None})
    return out


def metric(b: RunningBackend, name: str) -> float:
    text = httpx.get(f"{b.url}/metrics").text
    return sum(float(x.split()[-1]) for x in text.splitlines() if x.startswith(name))


def test_prefill_decode_handoff_like_a_proxy(backend_factory: Factory) -> None:
    p = backend_factory(role="prefill")
    d = backend_factory(role="decode")
    body = {"model": "llama-3-8b", "prompt": PROMPT, "max_tokens": 16, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    headers = {"X-Request-Id": "req-42"}
    r = post(f"{p.url}/v1/completions", prefill_body(body), headers)
    assert r.status_code == 200, r.text
    kvp = r.json()["kv_transfer_params"]
    assert kvp["do_remote_prefill"] is True and kvp["do_remote_decode"] is False
    assert kvp["remote_request_id"] == "req-42" and kvp["remote_port"] == p.config.port
    assert kvp["remote_host"] == "127.0.0.1" and kvp["tp_size"] == 1
    prompt_tokens = r.json()["usage"]["prompt_tokens"]
    assert len(kvp["remote_block_ids"]) == -(-(prompt_tokens + 1) // 16)
    state = get_json(f"{p.url}/admin/state")
    assert state["kv"]["held_requests"] == 1  # blocks kept for the decode instance

    c = openai.OpenAI(base_url=f"{d.url}/v1", api_key="x", max_retries=0)
    chunks = list(c.completions.create(
        model="llama-3-8b", prompt=PROMPT, max_tokens=16, stream=True,
        stream_options={"include_usage": True}, extra_headers=headers,
        extra_body={"ignore_eos": True, "kv_transfer_params": kvp}))
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == 16
    assert usage.prompt_tokens == prompt_tokens
    assert metric(d, "tokengate_backend_kv_transfer_tokens_total") == prompt_tokens
    # The decode instance computed only the last prompt token (the rest came by transfer).
    assert metric(d, "vllm:prompt_tokens_total") == 1
    # Both sides are back to zero: the decode side released the prefill side's blocks.
    assert_idle(p)
    assert_idle(d)
    assert get_json(f"{p.url}/admin/state")["kv"]["held_requests"] == 0

    # Same prompt again: the decode instance now caches most of it and pulls only the rest.
    r2 = post(f"{p.url}/v1/completions", prefill_body(body), {"X-Request-Id": "req-43"})
    kvp2 = r2.json()["kv_transfer_params"]
    c.completions.create(model="llama-3-8b", prompt=PROMPT, max_tokens=4,
                         extra_body={"kv_transfer_params": kvp2})
    pulled = metric(d, "tokengate_backend_kv_transfer_tokens_total") - prompt_tokens
    assert pulled == prompt_tokens - (prompt_tokens - 1) // 16 * 16
    assert_idle(p)


def test_failed_pull_recomputes_locally(backend_factory: Factory) -> None:
    d = backend_factory(role="decode")
    bogus = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "gone",
             "remote_request_id": "nope", "remote_block_ids": [1, 2], "remote_host": "127.0.0.1",
             "remote_port": d.config.port}
    r = post(f"{d.url}/v1/completions", {"model": "llama-3-8b", "prompt": PROMPT,
                                         "max_tokens": 3, "kv_transfer_params": bogus})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    assert metric(d, "tokengate_backend_kv_transfer_failures_total") == 1
    assert metric(d, "vllm:prompt_tokens_total") == r.json()["usage"]["prompt_tokens"]
    assert_idle(d)


def test_unpulled_kv_is_freed_after_the_hold_timeout(backend_factory: Factory) -> None:
    p = backend_factory(role="prefill", kv_hold_timeout_s=0.3)
    body = {"model": "llama-3-8b", "prompt": PROMPT, "max_tokens": 5}
    r = post(f"{p.url}/v1/completions", prefill_body(body))
    assert r.status_code == 200
    assert get_json(f"{p.url}/admin/state")["kv"]["held_requests"] == 1
    time.sleep(1.5)
    assert_idle(p)


def test_wrong_role_is_refused_with_retry(backend_factory: Factory) -> None:
    d = backend_factory(role="decode")
    r = post(f"{d.url}/v1/completions", prefill_body({"model": "llama-3-8b", "prompt": "x"}))
    assert r.status_code == 503 and r.json()["error"]["code"] == "wrong_role"
    p = backend_factory(role="prefill")
    r = post(f"{p.url}/v1/completions", {"model": "llama-3-8b", "prompt": "x",
                                         "kv_transfer_params": {"do_remote_prefill": True}})
    assert r.status_code == 503
    r = post(f"{d.url}/v1/completions", {"model": "llama-3-8b", "prompt": "x",
                                         "kv_transfer_params": {"do_remote_prefill": True}})
    assert r.status_code == 400 and "remote_engine_id" in r.json()["error"]["message"]


def test_role_switch_drains_work_in_flight(backend_factory: Factory) -> None:
    p = backend_factory(role="prefill", time_scale=0.2)
    d = backend_factory(role="decode", time_scale=0.2)
    body = {"model": "llama-3-8b", "prompt": PROMPT, "max_tokens": 300, "ignore_eos": True}
    kvp = post(f"{p.url}/v1/completions", prefill_body(body)).json()["kv_transfer_params"]

    # prefill -> decode with KV still held: the role flips at once, the drain waits for it.
    sw = post(f"{p.url}/admin/role", {"role": "decode", "timeout_s": 0.2}).json()
    assert sw == {**sw, "role": "decode", "previous": "prefill", "drained": False, "pending": 1}
    assert get_json(f"{p.url}/admin/state")["role"] == "decode"

    # A decode in flight on d; converting d to prefill answers once that decode finished.
    done: dict[str, Any] = {}

    def decode() -> None:
        done["r"] = post(f"{d.url}/v1/completions", {**body, "kv_transfer_params": kvp})

    t = threading.Thread(target=decode)
    t.start()
    while get_json(f"{d.url}/admin/state")["in_flight"] == 0:
        time.sleep(0.005)
    t0 = time.monotonic()
    sw2 = post(f"{d.url}/admin/role", {"role": "prefill", "timeout_s": 30}).json()
    assert sw2["drained"] is True and sw2["pending"] == 0 and sw2["previous"] == "decode"
    t.join(30)
    assert done["r"].status_code == 200 and done["r"].json()["usage"]["completion_tokens"] == 300
    # 300 decode steps of ~8 ms at time-scale 0.2 take ~0.5 s: the switch waited for them.
    assert time.monotonic() - t0 >= sw2["drain_s"] > 0.2
    # The pull released p's blocks, so p is idle under its new role; d now takes prefills.
    assert_idle(p)
    assert get_json(f"{p.url}/admin/state")["kv"]["held_requests"] == 0
    r = post(f"{d.url}/v1/completions", prefill_body(body))
    assert r.status_code == 200 and "kv_transfer_params" in r.json()
    assert metric(d, 'tokengate_backend_role_info{engine="0",model_name="llama-3-8b",'
                     'role="prefill"}') == 1
    assert post(f"{d.url}/admin/role", {"role": "gpu"}).status_code == 400


def _recv(sub: zmq.Socket[bytes], until: Callable[[list[dict[str, Any]]], bool],
          timeout_s: float = 5.0) -> list[tuple[int, list[dict[str, Any]]]]:
    """(seq, events) batches off a SUB socket until ``until`` holds for every event seen."""
    got: list[tuple[int, list[dict[str, Any]]]] = []
    seen: list[dict[str, Any]] = []
    deadline = time.monotonic() + timeout_s
    while not until(seen):
        assert time.monotonic() < deadline, f"events seen: {seen[:3]}..."
        if not sub.poll(100):
            continue
        topic, seq, payload = sub.recv_multipart()
        assert topic == b"kv" and len(seq) == 8
        ts, events, rank = msgpack.unpackb(payload, strict_map_key=False)
        assert ts > 0 and rank == 0
        got.append((int.from_bytes(seq, "big"), events))
        seen.extend(events)
    return got


def test_kv_events_speak_vllms_zmq_format(backend_factory: Factory) -> None:
    """The reference backend publishes KV events as vLLM does: PUB frames [topic, seq,
    msgpack [ts, events, rank]], events tagged maps, a ROUTER replay socket."""
    pub, replay = free_port(), free_port()
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.bind(f"tcp://127.0.0.1:{pub}")  # the backend connects to a non-wildcard address
    try:
        b = backend_factory(num_gpu_blocks=64, kv_events=KVEventsConfig(
            f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}", "kv"))
        # PUB/SUB joins take a few hundred ms ("slow joiner": what the replay socket is for):
        # prompts until the subscriber hears one, then one it must hear whole.
        for i in range(50):
            post(f"{b.url}/v1/completions", {"model": "llama-3-8b", "max_tokens": 1,
                                             "prompt": f"warm-up {i} " + PROMPT[:100]})
            if sub.poll(100):
                break
        while sub.poll(200):
            sub.recv_multipart()
        post(f"{b.url}/v1/completions", {"model": "llama-3-8b", "prompt": PROMPT,
                                         "max_tokens": 1})
        batches = _recv(sub, lambda evs: sum(len(e["block_hashes"]) for e in evs
                                             if e["type"] == "BlockStored") >= 300 // 16)
        stored = [e for _, evs in batches for e in evs if e["type"] == "BlockStored"]
        e = stored[0]
        assert set(e) >= {"block_hashes", "parent_block_hash", "token_ids", "block_size",
                          "lora_id", "medium", "lora_name", "extra_keys"}
        assert e["parent_block_hash"] is None and e["medium"] == "GPU"
        assert e["block_size"] == 16 and len(e["token_ids"]) == 16 * len(e["block_hashes"])
        chain = [h for x in stored for h in x["block_hashes"]]
        assert all(x["parent_block_hash"] == chain[i - 1] for i, x in enumerate(stored) if i)
        # The replay socket answers every kept batch from a sequence on, then END_SEQ.
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(f"tcp://127.0.0.1:{replay}")
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        replayed = []
        while True:
            assert dealer.poll(5000)
            frames = dealer.recv_multipart()
            if frames[2] == (-1).to_bytes(8, "big", signed=True):
                break
            replayed.append(int.from_bytes(frames[2], "big"))
        assert replayed == list(range(replayed[-1] + 1))  # every batch, in order
        assert [seq for seq, _ in batches] == replayed[-len(batches):]
        dealer.close(0)
        # Filling the 64-block cache with another prompt evicts some and says so.
        post(f"{b.url}/v1/completions", {"model": "llama-3-8b", "prompt": "other words " * 500,
                                         "max_tokens": 1})
        _recv(sub, lambda evs: any(e["type"] == "BlockRemoved" for e in evs))
    finally:
        sub.close(0)
        ctx.term()


def test_a_kv_events_address_in_use_fails_the_start_and_leaves_nothing_open(
        tokenizer: Tokenizer) -> None:
    """The replay port is taken: the backend does not start, says which address, and the
    publisher's socket it had bound is closed again (the port can be bound at once)."""
    pub, replay = free_port(), free_port()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", replay))
        taken.listen(1)
        config = KVEventsConfig(f"tcp://*:{pub}", f"tcp://127.0.0.1:{replay}", "kv")
        try:
            start_backend(tokenizer, kv_events=config)
        except RuntimeError as exc:
            err = exc.__cause__
        else:
            raise AssertionError("the backend started on a replay port in use")
    assert isinstance(err, OSError)
    assert f"cannot bind tcp://127.0.0.1:{replay}" in str(err)
    with socket.socket() as s:
        s.bind(("0.0.0.0", pub))  # the PUB socket on tcp://*:pub was closed
