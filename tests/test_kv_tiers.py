"""KV tiers below GPU memory, piece by piece: the host tier's LRU and its events, the lookup
order GPU → host → pool, what a load costs, the pool's store, the scheduler's loads, the
gateway's index across media and its pricing of a candidate."""

from __future__ import annotations

import argparse
from pathlib import Path

import msgpack
import pytest

from backend import cli as backend_cli
from backend.block_pool import BlockPool, KVEvent
from backend.events import encode_event
from backend.kv_manager import KVCacheManager
from backend.kv_tiers import CPU, HostTier, LoadCost, TierWalk
from backend.kvpool_store import PoolBlock, PoolStore
from backend.request import Request, Status
from backend.scheduler import Scheduler, SchedulerConfig
from gateway.examples import DEMO_POLICY
from gateway.routing.endpoints import EngineView
from gateway.routing.kv_events import decode_batch
from gateway.routing.prefix import PreciseIndex
from gateway.routing.tiers import TierIndex, TierMatch, read_pool_capacity, read_tier_info
from protocol.kv_hash import BlockHash
from stack.pool_shape import PoolShape, resolve_ports

ROOT = Path(__file__).resolve().parent.parent


def stored(*hashes: int, medium: str = "GPU") -> KVEvent:
    return KVEvent("BlockStored", tuple(hashes), None, tuple(range(16 * len(hashes))),
                   medium=medium)


def test_host_tier_stores_computed_blocks_and_evicts_the_least_recently_used() -> None:
    host = HostTier(3)
    out = host.store([stored(1, 2), stored(3)])
    assert [(e.kind, e.block_hashes, e.medium) for e in out] == [
        ("BlockStored", (1, 2), CPU), ("BlockStored", (3,), CPU)]
    host.touch([BlockHash(1)])  # a hit: 1 is now the most recent, 2 the least
    out = host.store([stored(4)])
    assert [(e.kind, e.block_hashes) for e in out] == [("BlockStored", (4,)),
                                                      ("BlockRemoved", (2,))]
    assert 2 not in host and all(h in host for h in (1, 3, 4))
    # a block stored again is refreshed, not duplicated; CPU events are not re-stored
    assert host.store([stored(3), stored(9, medium=CPU)]) == []
    assert len(host) == 3 and host.stats.stored_blocks == 4 and host.stats.evicted_blocks == 1


def test_the_walk_goes_gpu_then_host_then_pool_and_stops_at_the_first_miss() -> None:
    host = HostTier(100)
    host.store([stored(12, 13, 15)])
    walk = TierWalk(host)
    hashes = [BlockHash(h) for h in (10, 11, 12, 13, 14, 15, 16, 17)]
    # 2 on GPU, 12-13 in host memory, 14 missing there: the pool's prefix covers 6 blocks
    hit = walk.plan(hashes, 2, 8, pool_prefix=6)
    assert hit is not None and (hit.gpu, hit.host, hit.pool) == (2, 2, 2)
    # 15 is in host memory but after a hole: never used
    no_pool = walk.plan(hashes, 2, 8, pool_prefix=0)
    assert no_pool is not None and (no_pool.host, no_pool.pool) == (2, 0)
    # nothing below the GPU hit: no load
    assert walk.plan(hashes, 4, 8, pool_prefix=3) is None
    # the last token is always computed: at most max_blocks
    capped = walk.plan(hashes, 2, 3, pool_prefix=8)
    assert capped is not None and (capped.host, capped.pool) == (1, 0)
    assert walk.queried_blocks == 6 + 6 + 4 + 1


def test_load_time_arithmetic() -> None:
    cost = LoadCost(kv_bytes_per_token=262144, tensor_parallel=2, pcie_bytes_per_s=50e9,
                    link_bits_per_s=400e9, link_latency_s=100e-6)
    # host: each rank loads its half over its own PCIe link
    assert cost.seconds(10_000, 0) == pytest.approx(10_000 * 131072 / 50e9)
    # the pool: latency + the whole model's bytes over the link, after the host leg
    assert cost.seconds(0, 10_000) == pytest.approx(100e-6 + 10_000 * 262144 * 8 / 400e9)
    assert cost.seconds(1000, 2000) == pytest.approx(cost.seconds(1000, 0)
                                                     + cost.seconds(0, 2000))
    assert cost.seconds(0, 0) == 0.0


def test_events_carry_their_medium_on_the_wire() -> None:
    events = [stored(5, medium=CPU), KVEvent("BlockRemoved", (5,), medium="POOL"),
              KVEvent("BlockStored", (7,), None, tuple(range(32)), medium="POOL",
                      block_size=32)]
    payload = msgpack.packb([0.0, [encode_event(e, 16) for e in events], 0])
    _, decoded = decode_batch(payload)
    assert [(e.type, e.medium, e.block_size) for e in decoded] == [
        ("BlockStored", CPU, 16), ("BlockRemoved", "POOL", 0), ("BlockStored", "POOL", 32)]


def test_pool_store_is_an_lru_in_bytes_with_prefix_lookups() -> None:
    pool = PoolStore(capacity_bytes=300)
    for h in (1, 2, 3):
        assert pool.put(h, PoolBlock(h - 1 or None, (h,), None, 100, 16))
    assert pool.lookup([1, 2, 3, 4]) == 3 and pool.lookup([2, 9, 3]) == 1
    assert pool.fetch([1]) == (1, 100)  # 1 is now the most recent
    pool.put(4, PoolBlock(3, (4,), None, 100, 16))  # over capacity: 2 goes
    assert 2 not in pool and pool.used_bytes == 300 and pool.stats.evictions == 1
    assert pool.lookup([1, 2]) == 1
    assert not pool.put(5, PoolBlock(None, (), None, 301, 16))  # can never fit
    kinds = [(e.kind, e.block_hashes, e.medium) for e in pool.drain_events()]
    assert kinds[-1] == ("BlockRemoved", (2,), "POOL")
    assert [k for k in kinds if k[0] == "BlockStored"] == [
        ("BlockStored", (h,), "POOL") for h in (1, 2, 3, 4)]


def _scheduler(blocks: int, host: HostTier) -> Scheduler:
    pool = BlockPool(blocks)
    kv = KVCacheManager(pool, 16, BlockHash(7))
    s = Scheduler(SchedulerConfig(8192, 16, 16), kv)
    s.tiers = TierWalk(host)
    return s


def test_a_request_found_in_host_memory_waits_for_its_load_then_computes_the_rest() -> None:
    host = HostTier(1000)
    s = _scheduler(64, host)
    first = Request("a", list(range(160)), 4, 4, 0.0)
    s.add(first)
    plan = s.schedule(0.0)
    assert not plan.loads and plan.scheduled[0][1] == 160
    s.update(plan)
    host.store(s.kv.pool.drain_events())  # the engine stores what the step computed
    s.finish(first, Status.FINISHED_STOPPED)
    s.kv.pool.reset_cache()  # GPU memory forgets: only host memory has the prefix now
    again = Request("b", [*list(range(160)), 1, 2], 4, 4, 0.0)
    s.add(again)
    plan = s.schedule(1.0)
    assert plan.loads == [again] and plan.empty
    assert again.status is Status.WAITING_FOR_REMOTE_KVS
    assert (again.tier_hit.gpu, again.tier_hit.host) == (0, 10)
    assert not s.has_work()  # a loading request spends no step
    s.tier_loaded(again, 10)
    plan = s.schedule(2.0)
    assert [(r.request_id, n, ctx) for r, n, ctx in plan.scheduled] == [("b", 2, 160)]
    assert again.num_cached_tokens == 160


def test_a_partial_fetch_computes_what_did_not_arrive_and_nothing_loops() -> None:
    host = HostTier(1000)
    s = _scheduler(64, host)
    req = Request("p", list(range(100)), 4, 4, 0.0)
    s.kv.update_hashes(req)
    req.pool_prefix = 6  # the pool said it held 6 blocks
    s.add(req)
    plan = s.schedule(0.0)
    assert plan.loads == [req] and req.tier_hit.pool == 6
    s.tier_loaded(req, 2)  # it had evicted all but 2 by the fetch
    plan = s.schedule(1.0)
    assert [(n, ctx) for _, n, ctx in plan.scheduled] == [(100 - 32, 32)]
    nothing = Request("q", list(range(500, 600)), 4, 4, 0.0)
    s.kv.update_hashes(nothing)
    nothing.pool_prefix = 6
    s.add(nothing)
    plan = s.schedule(2.0)
    assert plan.loads == [nothing]
    s.tier_loaded(nothing, 0)  # the pool had nothing after all: computed from scratch
    plan = s.schedule(3.0)
    assert ("q", 100, 0) in [(r.request_id, n, ctx) for r, n, ctx in plan.scheduled]
    assert not plan.loads


def test_the_precise_index_keeps_each_medium_and_the_pool() -> None:
    idx = PreciseIndex(same_hashes=True)
    ev = [stored(1, 2, 3), stored(1, 2, 3, 4, 5, medium=CPU)]
    idx.apply("e1", decode_batch(msgpack.packb([0.0, [encode_event(e, 16) for e in ev], 0]))[1])
    removed = [KVEvent("BlockRemoved", (2, 3))]
    idx.apply("e1", decode_batch(msgpack.packb(
        [0.0, [encode_event(e, 16) for e in removed], 0]))[1])
    pool_ev = [stored(1, 2, 3, 4, 5, 6, medium="POOL")]
    idx.apply("http://pool", decode_batch(msgpack.packb(
        [0.0, [encode_event(e, 16) for e in pool_ev], 0]))[1])
    hashes = [1, 2, 3, 4, 5, 6, 7]
    assert idx.matched("e1", hashes) == 1  # GPU lost 2 and 3; host memory keeps them
    assert idx.size("e1", CPU) == 5
    view = EngineView(host_blocks=100, host_s_per_token=1e-6, pool_s_per_token=2e-6,
                      pool_latency_s=1e-4)
    t = TierIndex().lookup("e1", view, hashes, 1, 7, "http://pool", idx)
    assert (t.host, t.pool) == (4, 1)
    assert t.load_ms(view, 16) == pytest.approx((4 * 16 * 1e-6 + 1e-4 + 16 * 2e-6) * 1e3)
    # an engine without a pool, or without host memory, gets no credit for them
    no_pool = EngineView(host_blocks=100, host_s_per_token=1e-6)
    assert TierIndex().lookup("e1", no_pool, hashes, 1, 7, "http://pool", idx) == \
        TierMatch(4, 0)
    assert TierIndex().lookup("e1", EngineView(), hashes, 1, 7, None, idx) == TierMatch(0, 0)


def test_the_approximate_tiers_follow_what_was_routed_under_their_capacities() -> None:
    tiers = TierIndex()
    view = EngineView(host_blocks=4, host_s_per_token=1e-6, pool_s_per_token=1e-6)
    tiers.set_host_capacity("e1", 4)
    tiers.set_pool_capacity("pool", 1000)
    tiers.record("e1", view, [1, 2, 3, 4], "pool")
    assert tiers.lookup("e1", view, [1, 2, 3, 4, 5], 0, 5, "pool", None) == TierMatch(4, 0)
    assert tiers.lookup("e2", view, [1, 2, 3, 4, 5], 0, 5, "pool", None) == TierMatch(0, 4)
    tiers.record("e1", view, [9, 8, 7, 6, 5, 4, 3, 2, 1], "pool")  # host holds 4 of them
    assert tiers.approx_host.size("e1") <= 4 * 1.25


def test_tier_gauges_are_read_from_the_backends_metrics() -> None:
    text = ('tokengate_backend_kv_tier_info{block_bytes="4194304",capacity_blocks="1000",'
            'engine="0",latency_seconds="0",medium="CPU",model_name="m",'
            'seconds_per_token="2.5e-06"} 1.0\n'
            'tokengate_backend_kv_tier_info{block_bytes="4194304",capacity_blocks="0",'
            'engine="0",latency_seconds="0.0001",medium="POOL",model_name="m",'
            'seconds_per_token="5e-06"} 1.0\n')
    v = EngineView()
    read_tier_info(text, v)
    assert (v.host_blocks, v.host_s_per_token, v.pool_s_per_token, v.pool_latency_s,
            v.block_bytes) == (1000, 2.5e-6, 5e-6, 1e-4, 4194304)
    read_tier_info("vllm:num_requests_running 1\n", v)  # the tiers went away
    assert v.host_blocks is None and v.pool_s_per_token is None
    assert read_pool_capacity("# HELP x\ntokengate_kvpool_capacity_bytes 2e+12\n") == 2e12
    assert read_pool_capacity("nothing 1\n") is None


def test_up_flags_give_every_backend_host_memory_and_one_pool_with_its_events(
        tmp_path: Path) -> None:
    src = tmp_path / "p.yaml"
    src.write_text(DEMO_POLICY.read_text())
    shape = PoolShape(backends=2, index="precise", kv_offload_gb=512, kv_pool_gb=100)
    path, policy = resolve_ports(str(src), shape)
    m = policy.models["demo-large"]
    assert (m.backend.kv_offload_gb, m.backend.kv_pool_gb) == (512, 100)
    assert m.kv_pool is not None and m.kv_pool.url.startswith("http://127.0.0.1:")
    assert not m.kv_pool.url.endswith(":0")  # given a free port, like the backends
    assert m.kv_pool.kv_events is not None  # the precise index follows the pool too
    assert all(e.kv_events is not None for e in m.endpoints)
    assert m.routing.kv_tiers
    _, gpu_only = resolve_ports(str(src), PoolShape(gpu_only_routing=True))
    assert not gpu_only.models["demo-large"].routing.kv_tiers
    Path(path).unlink()


@pytest.mark.parametrize(("flags", "message"), [
    (["--kv-offload-gb", "-1"], "must not be negative"),
    (["--kv-pool", "ftp://127.0.0.1:1"], "expected http://HOST:PORT"),
    (["--kv-pool", "http://user:pw@127.0.0.1:1"], "expected http://HOST:PORT"),
    (["--kv-pool", "http://127.0.0.1:1/some/path"], "expected http://HOST:PORT"),
])
def test_backend_tier_flags_are_checked(flags: list[str], message: str) -> None:
    parser = argparse.ArgumentParser()
    backend_cli.add_parser(parser.add_subparsers(dest="command"))
    with pytest.raises(ValueError, match=message):
        backend_cli.backend_config(parser.parse_args(["backend", *flags]))


def test_backend_tier_flags_become_its_configuration(monkeypatch: pytest.MonkeyPatch) -> None:
    parser = argparse.ArgumentParser()
    backend_cli.add_parser(parser.add_subparsers(dest="command"))
    args = ["backend", "--kv-offload-gb", "64", "--kv-pool", "http://127.0.0.1:9600/",
            "--kv-pool-token-env", "TG_TEST_POOL_TOKEN"]
    monkeypatch.delenv("TG_TEST_POOL_TOKEN", raising=False)
    with pytest.raises(ValueError, match="TG_TEST_POOL_TOKEN"):
        backend_cli.backend_config(parser.parse_args(args))
    monkeypatch.setenv("TG_TEST_POOL_TOKEN", "s" * 20)
    cfg = backend_cli.backend_config(parser.parse_args(args))
    assert (cfg.kv_offload_bytes, cfg.kv_pool_url, cfg.kv_pool_token) == (
        64e9, "http://127.0.0.1:9600", "s" * 20)


def test_a_gpu_cache_reset_leaves_the_host_memory_index() -> None:
    idx = PreciseIndex(same_hashes=True)
    ev = [stored(1, 2), stored(1, 2, medium=CPU), KVEvent("AllBlocksCleared")]
    idx.apply("e", decode_batch(msgpack.packb([0.0, [encode_event(e, 16) for e in ev], 0]))[1])
    assert idx.size("e") == 0 and idx.size("e", CPU) == 2
