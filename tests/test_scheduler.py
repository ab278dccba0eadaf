"""The step planner: token budget, chunked prefill, prefix hits, preemption, accounting."""

from __future__ import annotations

import pytest

from backend.block_pool import BlockPool
from backend.kv_manager import KVCacheManager
from backend.request import Request, Status
from backend.scheduler import Scheduler, SchedulerConfig, StepPlan
from protocol.kv_hash import extend_block_hashes, root_hash

BS = 4


def make(budget: int = 64, max_seqs: int = 16, blocks: int = 64) -> Scheduler:
    pool = BlockPool(blocks)
    kv = KVCacheManager(pool, BS, root_hash("test"))
    return Scheduler(SchedulerConfig(budget, max_seqs, BS), kv)


def req(rid: str, prompt: list[int], max_tokens: int = 4, target: int | None = None) -> Request:
    return Request(rid, prompt, max_tokens, target or max_tokens, 0.0)


def step(s: Scheduler) -> StepPlan:
    """One step: plan, 'run', apply; sampled requests get token 7; finished ones leave."""
    plan = s.schedule(0.0)
    for r in s.update(plan):
        status = r.append_output(7)
        if status is not None:
            s.finish(r, status)
    return plan


def shape(plan: StepPlan) -> list[tuple[str, int, int]]:
    return [(r.request_id, n, ctx) for r, n, ctx in plan.scheduled]


def idle(s: Scheduler) -> bool:
    pool = s.kv.pool
    return pool.num_free == pool.num_blocks and all(b.ref_cnt == 0 for b in pool.blocks) \
        and s.kv.num_requests() == 0


def test_budget_chunks_prefill_and_serves_running_first() -> None:
    s = make(budget=8)
    a, b = req("a", list(range(10))), req("b", list(range(100, 106)))
    s.add(a)
    s.add(b)
    assert shape(step(s)) == [("a", 8, 0)]  # a's prompt is chunked; b waits for budget
    assert a.num_output_tokens == 0 and b.status is Status.WAITING
    p2 = step(s)
    assert shape(p2) == [("a", 2, 8), ("b", 6, 0)]  # running first, then the waiting one
    assert p2.num_sampled() == 2 and a.num_output_tokens == 1 and b.num_output_tokens == 1
    assert shape(step(s)) == [("a", 1, 10), ("b", 1, 6)]  # both decode one token per step


def test_max_num_seqs_caps_the_batch() -> None:
    s = make(max_seqs=2)
    for i in range(3):
        s.add(req(f"r{i}", [i] * 5))
    assert [r for r, _, _ in shape(step(s))] == ["r0", "r1"]
    assert len(s.waiting) == 1


def test_prefix_hits_count_full_blocks_only() -> None:
    s = make()
    first = req("a", list(range(10)), max_tokens=1)
    s.add(first)
    step(s)
    assert first.status is Status.FINISHED_LENGTH and idle(s)
    # Shares 9 tokens = 2 full blocks (8 tokens) with the first request.
    second = req("b", [*range(9), 99, 98], max_tokens=1)
    s.add(second)
    assert shape(step(s)) == [("b", 3, 8)]
    assert second.num_cached_tokens == 8
    # Shares 6 tokens: only the first full block counts.
    third = req("c", [*range(6), 50, 51, 52], max_tokens=1)
    s.add(third)
    assert shape(step(s)) == [("c", 5, 4)]
    assert s.kv.stats.hits == 12 and s.kv.stats.queries == 10 + 11 + 9


def test_prefix_hit_leaves_the_last_token_to_compute() -> None:
    s = make()
    s.add(req("a", list(range(8)), max_tokens=1))
    step(s)
    again = req("b", list(range(8)), max_tokens=1)
    s.add(again)
    # All 8 tokens are cached, but at most prompt - 1 = 7 may hit: one full block (4).
    assert shape(step(s)) == [("b", 4, 4)]
    assert again.num_cached_tokens == 4


def test_cache_salt_separates_prefixes() -> None:
    s = make()
    s.add(req("a", list(range(9)), max_tokens=1))
    step(s)
    salted = Request("b", list(range(9)), 1, 1, 0.0, cache_salt="tenant-2")
    s.add(salted)
    assert shape(step(s)) == [("b", 9, 0)]


def test_lru_evicts_least_recently_freed_tail_first() -> None:
    s = make(blocks=6)
    s.add(req("a", list(range(8)), max_tokens=1))  # blocks A0 A1 (+1 for the sampled token)
    step(s)
    s.add(req("b", list(range(100, 108)), max_tokens=1))
    step(s)
    root = s.kv.root
    ha = extend_block_hashes([], list(range(8)), BS, root)
    hb = extend_block_hashes([], list(range(100, 108)), BS, root)
    assert all(s.kv.pool.lookup(x) for x in ha + hb)
    # 5 fresh blocks are needed: the one never-used block, then a's blocks (freed first,
    # tail before head), then b's tail.
    s.add(req("c", list(range(200, 217)), max_tokens=1))
    step(s)
    assert s.kv.pool.lookup(ha[0]) is None and s.kv.pool.lookup(ha[1]) is None
    assert s.kv.pool.lookup(hb[1]) is None and s.kv.pool.lookup(hb[0]) is not None


def test_preemption_frees_the_last_running_request_and_recomputes_it() -> None:
    s = make(budget=64, blocks=5)
    a = req("a", list(range(8)), max_tokens=8)
    b = req("b", list(range(100, 108)), max_tokens=8)
    s.add(a)
    s.add(b)
    step(s)  # each prefilled 8 tokens into 2 blocks and sampled one: 9 tokens, 3 blocks each?
    # 5 blocks: a needs 3 (9 tokens), b would need 3: only 2 left for b's 8 prompt tokens...
    assert a.num_output_tokens == 1 and b.num_output_tokens == 1
    plans = [step(s) for _ in range(3)]
    preempted = [r.request_id for p in plans for r in p.preempted]
    assert preempted == ["b"]
    assert b.num_preemptions == 1 and s.num_preemptions == 1
    # After the preemption b is back at the front of the queue with nothing computed...
    while a.status is Status.RUNNING:
        step(s)
    assert a.status is Status.FINISHED_LENGTH
    # ...and resumes by recomputing prompt and generated tokens (with prefix hits allowed).
    resumed = s.schedule(0.0)
    ((rid, n, ctx),) = shape(resumed)
    assert rid == "b" and ctx + n == b.num_tokens == 9  # prompt and generated token again
    assert ctx == 4  # b's head block survived in the prefix cache; its tail was evicted
    for r in s.update(resumed):
        r.append_output(7)
    while b.status is Status.RUNNING:
        step(s)
    assert b.num_output_tokens == 8 and idle(s)


def test_abort_and_finish_return_every_block() -> None:
    s = make(budget=6)
    a = req("a", list(range(20)), max_tokens=50)
    b = req("b", list(range(30, 40)), max_tokens=3)
    s.add(a)
    s.add(b)
    step(s)
    step(s)
    s.finish(a, Status.FINISHED_ABORTED)  # mid-prefill
    while b.status in (Status.WAITING, Status.RUNNING):
        step(s)
    assert b.status is Status.FINISHED_LENGTH and idle(s)
    # A waiting request that is aborted never held blocks, and leaves none behind.
    c = req("c", [1, 2, 3])
    s.add(c)
    s.finish(c, Status.FINISHED_ABORTED)
    assert idle(s) and not s.waiting


def test_eos_before_max_tokens_finishes_with_stop() -> None:
    s = make()
    r = req("a", [1, 2, 3], max_tokens=10, target=3)
    s.add(r)
    while not r.status.finished:
        step(s)
    assert r.status is Status.FINISHED_STOPPED and r.num_output_tokens == 3 and idle(s)


def test_priority_policy_orders_the_queue_and_preempts_the_least_urgent() -> None:
    """vLLM's ``--scheduling-policy priority``: waiting requests by (priority, arrival); for KV,
    the running request last in that order is preempted (here the one admitted first, which
    FCFS would keep), its scheduled tokens taken out of the step."""
    pool = BlockPool(5)
    s = Scheduler(SchedulerConfig(64, 16, BS, policy="priority"),
                  KVCacheManager(pool, BS, root_hash("test")))
    late_urgent = Request("u", list(range(8)), 8, 8, 2.0, priority=-1)
    early = Request("e", list(range(100, 108)), 8, 8, 1.0, priority=5)
    s.add(early)
    s.add(late_urgent)
    assert [r.request_id for r in s.waiting] == ["u", "e"]
    first = step(s)
    assert [r.request_id for r, _, _ in first.scheduled] == ["u", "e"]
    plans = [step(s) for _ in range(3)]
    preempted = [r.request_id for p in plans for r in p.preempted]
    assert preempted == ["e"]
    for p in plans:
        assert all(r.status is Status.RUNNING for r, _, _ in p.scheduled)
    # A request behind e in arrival but ahead in priority goes first when both wait.
    s.add(Request("x", list(range(200, 204)), 2, 2, 3.0, priority=0))
    assert [r.request_id for r in s.waiting][:2] == ["x", "e"]


def test_priority_preempts_an_urgent_requests_elder_even_when_it_was_admitted_first() -> None:
    pool = BlockPool(5)
    s = Scheduler(SchedulerConfig(64, 16, BS, policy="priority"),
                  KVCacheManager(pool, BS, root_hash("test")))
    lazy = Request("lazy", list(range(8)), 8, 8, 1.0, priority=9)
    s.add(lazy)
    step(s)  # lazy runs alone first
    urgent = Request("urgent", list(range(100, 108)), 8, 8, 2.0, priority=0)
    s.add(urgent)
    preempted = [r.request_id for _ in range(4) for r in step(s).preempted]
    assert preempted and set(preempted) == {"lazy"}  # FCFS would have preempted urgent
    while urgent.status is Status.RUNNING:
        step(s)
    assert urgent.num_output_tokens == 8


def test_an_unknown_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="scheduling policy"):
        Scheduler(SchedulerConfig(policy="random"),
                  KVCacheManager(BlockPool(4), BS, root_hash("t")))
