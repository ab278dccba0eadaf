"""Routing units: block hashing, the prefix indexes, plugins, the PD decider, endpoint scrape."""

from __future__ import annotations

import asyncio
import math
import random
from typing import Any

import msgpack
import numpy as np
import pytest
from conftest import scrape_once

from gateway.config.policy import parse_policy
from gateway.counting.tokenize import TokenCounter
from gateway.routing import plugins
from gateway.routing.approx_index import ApproxIndex
from gateway.routing.endpoints import STEP_TAU_S, EndpointPool, EndpointState, EngineView, LiveLoad
from gateway.routing.fleet import Fleet, parse_vllm_metrics
from gateway.routing.kv_events import (
    DecodeError,
    EngineEvent,
    connect_address,
    decode_batch,
    engine_binds,
)
from gateway.routing.plugins import Candidate, PluginConfig, RequestInfo
from gateway.routing.prefix import PreciseIndex, PromptHasher, block_hashes
from gateway.routing.router import Router
from predictor.features import FEATURES, EndpointSnapshot, build_matrix
from protocol.kv_hash import extend_block_hashes, root_hash
from protocol.tokenizer import Tokenizer
from stack.pool_shape import PoolShape

ROOT = root_hash("llama-3-8b")


# -- block hashing ----------------------------------------------------------------------------

def test_only_full_blocks_are_hashed_and_hashes_chain() -> None:
    ids = list(range(100, 164))
    assert len(block_hashes(ids[:15], 16, ROOT)) == 0
    assert len(block_hashes(ids[:31], 16, ROOT)) == 1
    assert len(block_hashes(ids[:32], 16, ROOT)) == 2
    base = block_hashes(ids, 16, ROOT)
    changed = list(ids)
    changed[3] += 1  # a token of the first block: every later hash changes (chaining)
    assert all(a != b for a, b in zip(base, block_hashes(changed, 16, ROOT), strict=True))
    changed = list(ids)
    changed[40] += 1  # third block: the first two stay
    other = block_hashes(changed, 16, ROOT)
    assert other[:2] == base[:2] and other[2] != base[2] and other[3] != base[3]


def test_model_and_salt_separate_caches() -> None:
    ids = list(range(500, 564))
    plain = block_hashes(ids, 16, ROOT)
    assert set(plain).isdisjoint(block_hashes(ids, 16, root_hash("llama-3-70b")))
    assert set(plain).isdisjoint(block_hashes(ids, 16, ROOT, salt="tenant-a"))
    assert block_hashes(ids, 16, ROOT, salt="t") == block_hashes(ids, 16, ROOT, salt="t")


def test_gateway_hashes_equal_the_backends(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 20)
    theirs: list[Any] = []
    extend_block_hashes(theirs, ids, 16, ROOT, "salt")
    assert block_hashes(ids, 16, ROOT, "salt") == theirs


def test_chat_hashes_are_incremental_and_match_the_backend_template(
        tokenizer: Tokenizer) -> None:
    counter = TokenCounter(tokenizer)
    hasher = PromptHasher("llama-3-8b", 16)
    msgs: list[dict[str, str]] = [{"role": "system", "content": "You are terse. " * 30}]

    async def go() -> None:
        for turn in range(6):
            msgs.append({"role": "user", "content": f"question {turn} " + "detail " * 25})
            hashes, n = hasher.chat(await counter.chat_prompt(msgs))
            ids = tokenizer.chat_ids(msgs)
            assert n == len(ids) == await counter.chat(msgs)
            assert list(hashes) == block_hashes(ids, 16, hasher.root)
            msgs.append({"role": "assistant", "content": "answer " * (7 + turn)})

    before = hasher.blocks_hashed
    asyncio.run(go())
    # Every turn hashed only what it added: far fewer blocks than re-hashing each prompt.
    total_blocks = sum(len(tokenizer.chat_ids(msgs[:k])) // 16 for k in range(2, 13, 2))
    assert hasher.blocks_hashed - before < total_blocks / 2


# -- indexes ------------------------------------------------------------------------------------

def test_approx_index_longest_prefix_and_lru_eviction() -> None:
    idx = ApproxIndex()
    idx.set_capacity("a", 6)
    p = [1, 2, 3, 4]
    idx.record("a", p)
    assert idx.matched("a", [1, 2, 3, 4, 5]) == 4
    assert idx.matched("a", [1, 2, 9]) == 2
    assert idx.matched("a", [9, 1]) == 0
    assert idx.matched("b", p) == 0
    idx.record("a", [10, 11, 12])  # 7 blocks: within the 25% slack
    assert idx.size("a") == 7
    idx.record("a", [1, 2])  # the shared head of p is used again: recent now
    idx.record("a", [20, 21, 22])  # 10 > 7.5: down to the 6 most recently sent
    assert idx.size("a") == 6
    assert idx.matched("a", [20, 21, 22]) == 3
    assert idx.matched("a", p) == 2  # p's tail went first; its head was refreshed
    assert idx.matched("a", [10, 11, 12]) == 1  # the older prompt keeps only its head
    idx.set_capacity("a", 3)  # a smaller capacity scraped later trims at once
    assert idx.size("a") == 3 and idx.matched("a", [20, 21, 22]) == 3
    idx.forget("a")
    assert idx.matched("a", [20]) == 0


def test_approx_index_records_a_long_prompt_in_steps_and_ends_as_if_at_once() -> None:
    """With ``chunk``, a prompt of many blocks holds the event loop one chunk at a time: its
    head is matched at once, the rest after a few loop steps, and the LRU order it leaves
    (tail evicted first) is the one a whole record leaves."""
    whole, steps = ApproxIndex(), ApproxIndex()
    steps.chunk = 10
    for idx in (whole, steps):
        idx.set_capacity("a", 100)
    older, prompt = list(range(1000, 1030)), list(range(1, 46))

    async def go() -> None:
        whole.record("a", older)
        whole.record("a", prompt)
        steps.record("a", older)
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert steps.matched("a", older) == 30
        steps.record("a", prompt)
        assert steps.matched("a", prompt[:10]) == 10  # the head: at once
        assert steps.size("a") < whole.size("a")
        for _ in range(6):
            await asyncio.sleep(0)
        assert steps.matched("a", prompt) == 45
        assert list(steps.held("a") or {}) == list(whole.held("a") or {})
        for idx in (whole, steps):  # over capacity: the older prompt goes, then the tail
            idx.record("a", list(range(2000, 2060)))
        for _ in range(8):
            await asyncio.sleep(0)
        assert list(steps.held("a") or {}) == list(whole.held("a") or {})
        assert steps.matched("a", prompt) == 40 and steps.matched("a", older) == 0

    asyncio.run(go())


def _stored(hashes: list[Any], parent: Any, tokens: list[int], **kw: Any) -> EngineEvent:
    return EngineEvent("BlockStored", hashes, parent, tokens, 4, medium=kw.pop("medium", "GPU"),
                       **kw)


def test_precise_index_relates_engine_hashes_to_ours_through_token_ids() -> None:
    """The engine's block hashes are opaque (vLLM's own function): the index rebuilds our
    chained hashes from the events' token ids, so a prompt's hashes match what it holds."""
    idx = PreciseIndex()
    idx.set_root("a", ROOT)
    prompt = list(range(100, 116))  # 4 blocks of 4
    ours = block_hashes(prompt, 4, ROOT)
    idx.apply("a", [_stored([b"e1", b"e2"], None, prompt[:8])])
    idx.apply("a", [_stored([b"e3"], b"e2", prompt[8:12])])
    assert idx.matched("a", ours) == 3 and idx.size("a") == 3
    idx.record("a", ours)  # decisions do not change the precise view
    assert idx.matched("a", ours) == 3
    idx.apply("a", [EngineEvent("BlockRemoved", [b"e3"], medium="GPU")])
    assert idx.matched("a", ours) == 2
    # The cache salt rides in a first block's extra keys, as in vLLM's events.
    salted = block_hashes(prompt, 4, ROOT, salt="tenant-a")
    idx.apply("a", [_stored([b"s1"], None, prompt[:4], extra_keys=[["tenant-a"]])])
    assert idx.matched("a", salted) == 1
    # Offloaded copies are kept apart; LoRA and multimodal blocks are not text prefixes.
    idx.apply("a", [_stored([b"c1"], None, [9, 9, 9, 9], medium="CPU")])
    assert idx.size("a", "CPU") == 1 and idx.matched("a", block_hashes([9] * 4, 4, ROOT)) == 0
    idx.apply("a", [_stored([b"l1"], None, [7] * 4, lora_name="adapter")])
    idx.apply("a", [_stored([b"m1"], None, [8] * 4, extra_keys=[[["mm", "img", 0]]])])
    assert idx.matched("a", block_hashes([7] * 4, 4, ROOT)) == 0
    assert idx.matched("a", block_hashes([8] * 4, 4, ROOT)) == 0
    # A block whose parent was never seen cannot be placed: counted, not guessed.
    idx.apply("a", [_stored([b"x2"], b"unknown", [1, 2, 3, 4])])
    assert idx.unmapped == 1
    idx.apply("a", [EngineEvent("AllBlocksCleared")])
    assert idx.matched("a", ours) == 0 and idx.size("a") == 0


def test_kv_event_batches_decode_in_both_vllm_layouts() -> None:
    new = msgpack.packb([1.5, [{"type": "BlockStored", "block_hashes": [1], "parent_block_hash":
                                None, "token_ids": [1, 2], "block_size": 2, "lora_id": None,
                                "medium": "GPU", "lora_name": None, "extra_keys": [None],
                                "group_idx": 0, "kv_cache_spec_kind": "full_attention"},
                               {"type": "FutureEvent", "x": 1}], 0])
    ts, evs = decode_batch(new)
    assert ts == 1.5 and [e.type for e in evs] == ["BlockStored"] and evs[0].token_ids == [1, 2]
    old = msgpack.packb([2.0, [["BlockStored", [5], None, [1, 2], 2, None, "GPU"],
                               ["BlockRemoved", [5], "GPU"], ["AllBlocksCleared"]]])
    _, evs = decode_batch(old)
    assert [e.type for e in evs] == ["BlockStored", "BlockRemoved", "AllBlocksCleared"]
    assert evs[0].block_size == 2 and evs[1].block_hashes == [5]
    for bad in (b"\xc1", msgpack.packb({"a": 1}), msgpack.packb([1.0, [42]])):
        with pytest.raises(DecodeError):
            decode_batch(bad)


def test_zmq_addresses_follow_vllms_bind_or_connect_rule() -> None:
    assert engine_binds("tcp://*:5557") and engine_binds("tcp://[::1]:5557")
    assert engine_binds("ipc:///tmp/kv") and not engine_binds("tcp://127.0.0.1:5557")
    assert connect_address("tcp://*:5557", "http://127.0.0.1:8000/v1") == "tcp://127.0.0.1:5557"
    assert connect_address("tcp://[::]:5557", "http://[::1]:8000/v1") == "tcp://[::1]:5557"
    assert connect_address("ipc:///tmp/kv", "http://127.0.0.1:8000") == "ipc:///tmp/kv"


# -- plugins ------------------------------------------------------------------------------------

def cands(*spec: dict[str, Any]) -> list[Candidate]:
    out = []
    for i, s in enumerate(spec):
        ep = EndpointState(f"http://e{i}", live=LiveLoad(in_flight=s.get("in_flight", 0)),
                           engine=EngineView(kv_usage=s.get("kv", 0.0),
                                             waiting=s.get("waiting", 0.0)))
        out.append(Candidate(ep, s.get("cached", 0), 100 - s.get("cached", 0),
                             s.get("ttft", math.nan), s.get("tpot", math.nan)))
    return out


REQ = RequestInfo(prompt_tokens=100, expected_output=10)


@pytest.mark.parametrize(("scorer", "spec", "expected"), [
    ("least_request", [{"in_flight": 0}, {"in_flight": 2}, {"in_flight": 4}], [1.0, 0.5, 0.0]),
    ("least_request", [{"in_flight": 3}, {"in_flight": 3}], [1.0, 1.0]),
    ("queue", [{"waiting": 5}, {"waiting": 0}], [0.0, 1.0]),
    ("kv_free", [{"kv": 0.25}, {"kv": 1.0}], [0.75, 0.0]),
    ("prefix", [{"cached": 0}, {"cached": 50}, {"cached": 99}], [0.0, 0.5, 0.99]),
    ("predicted_ttft", [{"ttft": 100.0}, {"ttft": 200.0}, {"ttft": 400.0}], [1.0, 0.5, 0.25]),
    ("predicted_tpot", [{"tpot": 10.0}, {"tpot": 40.0}], [1.0, 0.25]),
])
def test_scorers_are_normalised(scorer: str, spec: list[dict[str, Any]],
                                expected: list[float]) -> None:
    got = plugins.SCORERS[scorer](REQ, cands(*spec))
    assert np.allclose(got, expected)
    assert ((got >= 0) & (got <= 1)).all()


def test_bounded_load_keeps_a_hot_prefix_from_piling_on() -> None:
    # Endpoint 0 holds the whole prompt but already has 6 of the 8 requests in flight.
    cs = cands({"cached": 99, "in_flight": 6}, {"in_flight": 1}, {"in_flight": 1})
    kept = plugins.bounded_load(REQ, cs, PluginConfig(load_factor=1.5))
    assert [c.ep.url for c in kept] == ["http://e1", "http://e2"]
    pick, _ = plugins.run(plugins.STRATEGIES["prefix"], REQ, cs, random.Random(0),
                          PluginConfig(load_factor=1.5))
    assert pick.ep.url != "http://e0"
    # Without the load, affinity wins.
    cs = cands({"cached": 99, "in_flight": 1}, {"in_flight": 1}, {"in_flight": 0})
    pick, _ = plugins.run(plugins.STRATEGIES["prefix"], REQ, cs, random.Random(0),
                          PluginConfig(load_factor=1.5))
    assert pick.ep.url == "http://e0"


def test_slo_filter_never_leaves_nothing() -> None:
    req = RequestInfo(100, 10, slo_tpot_ms=20.0)
    cs = cands({"ttft": 50.0, "tpot": 30.0}, {"ttft": 500.0, "tpot": 15.0})
    pick, _ = plugins.run(plugins.STRATEGIES["predicted"], req, cs, random.Random(0),
                          PluginConfig())
    assert pick.ep.url == "http://e1"  # the fast-TTFT endpoint would break the TPOT SLO
    cs = cands({"ttft": 50.0, "tpot": 30.0}, {"ttft": 500.0, "tpot": 35.0})
    pick, _ = plugins.run(plugins.STRATEGIES["predicted"], req, cs, random.Random(0),
                          PluginConfig())
    assert pick.ep.url == "http://e0"  # nobody meets it: the least bad by TTFT


def test_pickers_round_robin_and_seeded_ties() -> None:
    cfg = PluginConfig()
    cs = cands({}, {}, {})
    seen = [plugins.round_robin(cs, np.zeros(3), random.Random(0), cfg).ep.url
            for _ in range(6)]
    assert seen == ["http://e0", "http://e1", "http://e2"] * 2
    a = [plugins.max_score(cs, np.ones(3), random.Random(7), cfg).ep.url for _ in range(5)]
    rng = random.Random(7)
    b = [plugins.max_score(cs, np.ones(3), rng, cfg).ep.url for _ in range(1)]
    assert a[0] == b[0]
    picks = {plugins.max_score(cs, np.ones(3), rng, cfg).ep.url for _ in range(50)}
    assert len(picks) == 3  # ties spread, not always the first


# -- router: features and the PD decider ------------------------------------------------------

def pool_policy(roles: list[str], **routing: Any) -> tuple[EndpointPool, Fleet]:
    doc = {"version": 1, "models": {"m": {
        "endpoints": [{"url": f"http://127.0.0.1:{9000 + i}/v1", "role": r,
                       "hardware": "h100-sxm"} for i, r in enumerate(roles)],
        "routing": {"block_size": 16, **routing}}},
        "tenants": {"t": {"keys": [{"sha256": "0" * 64}]}},
        "routes": {"r": {"tenants": ["t"], "models": ["m"]}}}
    m = parse_policy(doc).models["m"]
    fleet = Fleet()
    eps = [fleet.endpoint(e.url, None, e.role, e.hardware) for e in m.endpoints]
    return EndpointPool(m, eps), fleet


def test_virtual_prefill_queue_learns_the_rate_and_discounts_the_head() -> None:
    import time as _time

    e = EndpointState("http://e")
    a = EndpointPool.acquire(e, 4000, 3000)
    b = EndpointPool.acquire(e, 2000, 1000)
    now = _time.monotonic()
    # Nothing observed yet: the default rate; the head has had ~0 ms to progress.
    assert e.live.prefill_queue_ms(now) == pytest.approx(4000 / 30.0, rel=0.01)
    # The head's first token arrives 100 ms after it was sent: 30 tokens/ms observed.
    sent_a = e.live.pending[a.key][0]
    e.live.prefill_done(a.key, 3000, sent_a + 0.1)
    assert e.live.prefill_rate == pytest.approx(30.0)
    e.live.prefill_tokens -= 3000
    # b is the head now, started when a finished: 10 ms later a third of it is done.
    assert e.live.prefill_queue_ms(sent_a + 0.11) == pytest.approx((1000 - 300) / 30.0)
    assert e.live.prefill_queue_ms(sent_a + 1.0) == 0.0
    # A request finishing out of order teaches nothing about the head's rate.
    c = EndpointPool.acquire(e, 600, 600)
    e.live.prefill_done(c.key, 600, sent_a + 0.2)
    assert e.live.prefill_rate == pytest.approx(30.0) and b.key in e.live.pending


def test_prefill_rate_is_tokens_over_time_when_heads_finish_in_one_step() -> None:
    e = EndpointState("http://e")
    a = EndpointPool.acquire(e, 3000, 3000)
    b = EndpointPool.acquire(e, 1000, 1000)
    t0 = e.live.pending[a.key][0]
    # 4,000 tokens in 400 ms: a's first token at 300 ms, b's (its prefill ended in the same
    # step) 1 ms later. Averaging per-request rates would say (10 + 1000) / 2 tokens/ms.
    e.live.prefill_done(a.key, 3000, t0 + 0.3)
    e.live.prefill_done(b.key, 1000, t0 + 0.301)
    assert e.live.prefill_rate == pytest.approx((3000 * 0.8 + 1000) / (300 * 0.8 + 1), rel=1e-6)
    assert 10 < e.live.prefill_rate < 15


def test_recent_latencies_are_moving_averages() -> None:
    e = EndpointState("http://e")
    e.live.observed(100.0, None)
    e.live.observed(None, 10.0)
    assert (e.live.recent_ttft_ms, e.live.recent_tpot_ms) == (100.0, 10.0)
    e.live.observed(200.0, 20.0)
    assert e.live.recent_ttft_ms == pytest.approx(130.0)
    assert e.live.recent_tpot_ms == pytest.approx(13.0)


def test_arrival_rate_decays() -> None:
    e = EndpointState("http://e")
    e.live.add_arrival(5000, 100.0)
    assert e.live.arrival_rate(100.0) == pytest.approx(1000.0)  # 5000 tokens over tau = 5 s
    assert e.live.arrival_rate(105.0) == pytest.approx(1000.0 / math.e)
    e.live.add_arrival(5000, 105.0)
    assert e.live.arrival_rate(105.0) == pytest.approx(1000.0 / math.e + 1000.0)


def test_current_step_is_sequence_time_over_tokens_relayed() -> None:
    e = EndpointState("http://x")
    assert e.live.current_step_ms(10.0) == 0.0  # nothing decoded yet: unknown
    e.live.decoding = 4  # four streams decode for 0.5 s and 100 tokens arrive: 20 ms a token each
    e.live.streamed += 100
    assert e.live.current_step_ms(10.5) == pytest.approx(20.0)
    e.live.decoding = 2  # then two streams for 0.5 s and 20 tokens (50 ms each): the sums are
    e.live.streamed += 20  # decayed and added, a ratio of sums, not a mean of the two ratios
    keep = math.exp(-0.5 / STEP_TAU_S)
    want = (2.0 * keep + 1.0) / (100 * keep + 20) * 1e3
    assert e.live.current_step_ms(11.0) == pytest.approx(want)
    assert 20.0 < want < 35.0
    e.live.streamed += 3
    assert e.live.current_step_ms(11.1) == pytest.approx(want)  # within a window: unchanged


def test_feature_matrix_columns() -> None:
    x = build_matrix(1000, 64, [400, 1000], [
        EndpointSnapshot(kv_usage=0.5, running=3, waiting=1, in_flight=2, prefill_tokens=800,
                         decoding=1, oldest_pending_ms=12.5, prefill_queue_ms=40.0,
                         prefill_rate=20.0,
                         prefill_arrivals=900.0, step_ms=11.0, recent_ttft_ms=80.0,
                         recent_tpot_ms=9.0, role="decode",
                         hw_bandwidth_tbs=3.35, hw_tflops=989.0, load_ms=7.5),
        EndpointSnapshot()])
    assert x.shape == (2, len(FEATURES))
    row = dict(zip(FEATURES, x[0], strict=True))
    assert row == {"prompt_tokens": 1000, "uncached_tokens": 400, "expected_output": 64,
                   "kv_usage": 0.5, "running": 3, "waiting": 1, "in_flight": 2,
                   "prefill_tokens": 800, "decoding": 1, "oldest_pending_ms": 12.5,
                   "prefill_queue_ms": 40.0, "queue_estimate_ms": 40.0 + 7.5 + 400 / 20.0,
                   "prefill_arrivals": 900.0, "step_ms": 11.0,
                   "recent_ttft_ms": 80.0, "recent_tpot_ms": 9.0, "role": 2.0,
                   "hw_bandwidth_tbs": 3.35,
                   "hw_tflops": 989.0, "prior_ttft_ms": 0.0, "prior_tpot_ms": 0.0,
                   "load_ms": 7.5}


def test_router_builds_features_from_live_and_scraped_state() -> None:
    from predictor.online import OnlinePredictor

    pool, fleet = pool_policy(["both", "both"])
    pool.endpoints[0].engine.waiting, pool.endpoints[0].engine.kv_usage = 2.0, 0.4
    EndpointPool.acquire(pool.endpoints[0], 500, 300)
    router = Router(pool, fleet, OnlinePredictor())
    hashes = block_hashes(list(range(64)), 16, router.hasher().root)
    fleet.approx.record(pool.endpoints[1].url, hashes[:2])
    d = router.decide(RequestInfo(64, 8, hashes, 16))
    assert d is not None
    by_url = {c.ep.url: c for c in [d.endpoint]}
    row = dict(zip(FEATURES, d.endpoint.row if d.endpoint.row is not None else [],
                   strict=True))
    # The idle endpoint that caches half the prompt is predicted faster and picked.
    assert list(by_url) == [pool.endpoints[1].url]
    assert row["uncached_tokens"] == 32 and row["in_flight"] == 0
    assert row["expected_output"] == 8 and row["oldest_pending_ms"] == 0
    assert row["hw_tflops"] == pytest.approx(989.0)


def test_hashing_a_long_prompt_takes_a_slot_of_its_tenant(tokenizer: Tokenizer) -> None:
    """A long prompt is hashed in the worker pool inside its tenant's counting slots, so one
    tenant's huge prompts (counted, then hashed) cannot hold the whole pool."""
    from concurrent.futures import ThreadPoolExecutor

    from gateway.counting.slots import CountingSlots
    from gateway.routing.router import HASH_OFFLOAD_TOKENS
    from predictor.online import OnlinePredictor

    pool, fleet = pool_policy(["both"])
    router = Router(pool, fleet, OnlinePredictor())
    ids = list(range(HASH_OFFLOAD_TOKENS + 64))
    slots = CountingSlots(2)  # one slot per tenant

    async def go() -> None:
        with ThreadPoolExecutor(2) as pool_:
            counter = TokenCounter(tokenizer, executor=pool_)

            def prepare(tenant: str) -> Any:
                return router.prepare(counter, chat=None, prompt_ids=ids, prompt_text=None,
                                      salt=None, prompt_tokens=len(ids), expected_output=8,
                                      slo_ttft_ms=None, slo_tpot_ms=None, priority="standard",
                                      slots=slots, tenant=tenant)

            async with slots.slot("heavy"):  # its one slot is counting another prompt
                other = await prepare("light")  # another tenant's goes on
                held = asyncio.ensure_future(prepare("heavy"))
                for _ in range(20):
                    await asyncio.sleep(0.005)
                assert not held.done()
            info = await held
            assert list(info.hashes) == list(other.hashes) and len(info.hashes) == len(ids) // 16
            assert slots.tenants == 0

    asyncio.run(go())


def test_pd_decider_prefills_remotely_unless_decode_caches_the_prompt() -> None:
    from predictor.online import OnlinePredictor

    pool, fleet = pool_policy(["prefill", "prefill", "decode"], remote_prefill_min_tokens=32)
    router = Router(pool, fleet, OnlinePredictor())
    hashes = block_hashes(list(range(1000)), 16, router.hasher().root)
    EndpointPool.acquire(pool.endpoints[0], 5000, 4000)  # prefill 0 is busy
    req = RequestInfo(1000, 8, hashes, 16)
    d = router.decide(req)
    assert d is not None and d.prefill is not None
    assert d.endpoint.ep.role == "decode" and d.prefill.ep is pool.endpoints[1]
    assert d.predicted_ttft_ms == d.prefill.ttft_ms
    assert router.decide(req).prefill is not None  # type: ignore[union-attr]
    # Sent: the prompt is now on the decode endpoint, so the next identical prompt is cached
    # there but for under 32 tokens, and is decoded without a remote prefill.
    router.commit(d, req)
    d2 = router.decide(req)
    assert d2 is not None and d2.prefill is None and d2.endpoint.uncached_tokens <= 32
    # No decode endpoint at all: no decision.
    assert router.decide(RequestInfo(1000, 8, hashes, 16), exclude=[pool.endpoints[2]]) is None


def test_a_converted_decoder_prefills_itself_when_that_is_sooner() -> None:
    from predictor.online import OnlinePredictor

    # One prefill endpoint and one decoder converted for a burst (role both).
    pool, fleet = pool_policy(["prefill", "both"], remote_prefill_min_tokens=32)
    router = Router(pool, fleet, OnlinePredictor())
    pre, conv = pool.endpoints
    hashes = block_hashes(list(range(1000)), 16, router.hasher().root)
    req = RequestInfo(1000, 8, hashes, 16)
    # Both idle: a tie on the virtual queue goes to the decoder itself (no KV transfer).
    d = router.decide(req)
    assert d is not None and d.endpoint.ep is conv and d.prefill is None
    # The prefill endpoint's queue is short, the decoder's long: prefill remotely.
    EndpointPool.acquire(conv, 9000, 8000)
    d = router.decide(req)
    assert d is not None and d.endpoint.ep is conv
    assert d.prefill is not None and d.prefill.ep is pre
    # The burst piles onto the prefill endpoint: the decoder computes the prompt itself.
    EndpointPool.acquire(pre, 30000, 30000)
    d = router.decide(req)
    assert d is not None and d.endpoint.ep is conv and d.prefill is None
    # A pure decoder never computes a long prompt itself while a prefill endpoint is up.
    pool2, fleet2 = pool_policy(["prefill", "decode"], remote_prefill_min_tokens=32)
    EndpointPool.acquire(pool2.endpoints[0], 30000, 30000)
    d2 = Router(pool2, fleet2, OnlinePredictor()).decide(req)
    assert d2 is not None and d2.prefill is not None


def test_round_robin_router_still_predicts_for_the_headers() -> None:
    from predictor.online import OnlinePredictor

    pool, fleet = pool_policy(["both", "both", "both"], strategy="round_robin")
    router = Router(pool, fleet, OnlinePredictor())
    urls = [router.decide(RequestInfo(10, 1)).endpoint.ep.url  # type: ignore[union-attr]
            for _ in range(6)]
    assert urls == [e.url for e in pool.endpoints] * 2
    d = router.decide(RequestInfo(10, 1))
    assert d is not None and math.isfinite(d.predicted_ttft_ms)


def test_policy_routing_section_is_strict() -> None:
    from gateway.config.policy import PolicyError

    with pytest.raises(PolicyError, match=r"models.m.routing.strategy: expected one of"):
        pool_policy(["both"], strategy="fastest")
    with pytest.raises(PolicyError, match=r"models.m.routing.scorers.prefx: unknown key"):
        pool_policy(["both"], scorers={"prefx": 1})
    with pytest.raises(PolicyError, match=r"models.m.routing.load_factor: must be at least 1"):
        pool_policy(["both"], load_factor=0.5)
    pool, _ = pool_policy(["both"], strategy="prefix", scorers={"prefix": 1, "queue": 2},
                          index="precise")
    r = pool.model.routing
    assert r.strategy == "prefix" and dict(r.scorers or {}) == {"prefix": 1, "queue": 2}


def test_parse_vllm_metrics(backend_factory: Any) -> None:
    import httpx

    b = backend_factory()
    m = parse_vllm_metrics(httpx.get(f"{b.url}/metrics").text)
    assert m["block_size"] == 16 and m["num_gpu_blocks"] > 1000
    assert m["vllm:num_requests_running"] == 0 and m["vllm:kv_cache_usage_perc"] == 0
    assert "vllm:prefix_cache_queries" in m
    read, ep = scrape_once(f"{b.url}/v1")
    assert read
    assert ep.engine.block_size == 16 and ep.engine.num_gpu_blocks == m["num_gpu_blocks"]


def test_scrape_failures_trip_and_recovery_restores(backend_factory: Any) -> None:
    from redis_servers import free_port

    fleet = Fleet(trip_after=2)
    dead = fleet.endpoint(f"http://127.0.0.1:{free_port()}/v1", None, "both", None)

    async def go() -> None:
        try:
            assert not await fleet.scrape(dead)
            assert dead.health.down_until == 0.0
            assert not await fleet.scrape(dead)
            assert dead.health.down_until > 0.0  # tripped: skipped by the pools until it answers
        finally:
            await fleet.close()

    asyncio.run(go())


def test_an_engine_without_metrics_is_reachable_not_down() -> None:
    """A real server whose ``/metrics`` is a 404 (an OpenAI-compatible engine without
    Prometheus) answered: the scrape reads nothing but does not trip it, and one that was out
    for failed connections is back."""
    from aiohttp import web

    from loadtests.echo_upstream import build
    from protocol.loopback import free_port

    fleet = Fleet(trip_after=1)
    port = free_port()
    ep = fleet.endpoint(f"http://127.0.0.1:{port}/v1", None, "both", None)

    async def go() -> None:
        runner = web.AppRunner(build(2))
        try:
            assert not await fleet.scrape(ep)  # nothing listens yet: a transport failure
            assert ep.health.down_until > 0.0
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", port).start()
            for _ in range(3):
                assert not await fleet.scrape(ep)  # no metrics to read
                assert ep.health.down_until == 0.0 and ep.health.consecutive_failures == 0
        finally:
            await fleet.close()
            await runner.cleanup()

    asyncio.run(go())


def test_pool_shape_flags_rewrite_the_demo_pool() -> None:
    raw: dict[str, Any] = {"models": {"demo-large": {"endpoints": [{"url": "http://x/v1"}]},
                                      "demo-small": {"endpoints": [{"url": "http://y/v1"}],
                                                     "limits": {"tpm": 5}}},
                           "tenants": {"demo": {"keys": [], "model_limits": {"x": {}}}}}
    assert PoolShape(pd="2:1", strategy="prefix", model="llama-3.1-8b",
                     hardware="h200", no_quota=True).apply(raw)
    m = raw["models"]["demo-large"]
    assert [e["role"] for e in m["endpoints"]] == ["prefill", "prefill", "decode"]
    assert all(e["url"] == "http://127.0.0.1:0/v1" for e in m["endpoints"])
    assert m["routing"] == {"strategy": "prefix"}
    assert m["backend"] == {"model": "llama-3.1-8b", "hardware": "h200"}
    assert "limits" not in raw["models"]["demo-small"]
    assert "model_limits" not in raw["tenants"]["demo"]
    with pytest.raises(ValueError, match="P:D"):
        PoolShape(pd="2").apply(raw)
    with pytest.raises(ValueError, match="no such model"):
        PoolShape(pool="nope", backends=2).apply(raw)
    assert not PoolShape().apply(raw)
