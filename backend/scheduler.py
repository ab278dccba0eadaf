"""vLLM v1's continuous-batching step planner, as a pure, synchronous object.

Each call to ``schedule`` returns the plan of one step under a token budget
(``max_num_batched_tokens``):

1. Running requests first, in order. Each asks for ``num_tokens - num_computed_tokens`` tokens
   (1 when decoding, the rest of its prompt when its prefill was chunked), capped by the budget.
   If the KV cache cannot hold them, the *last* running request is preempted (its blocks freed,
   its progress reset for recompute, put at the front of the waiting queue) until it fits; if
   the request itself was the last, it waits.
2. Then, if nothing was preempted this step, waiting requests in queue order while there is
   budget and fewer than ``max_num_seqs`` are running. A fresh (or preempted) request first
   takes its longest cached prefix; a prompt longer than the remaining budget is chunked.
   A batch holds the requests of at most ``max_loras`` LoRA adapters (as vLLM's
   ``--max-loras``): a request whose adapter would be one more waits, and those behind it go.
3. A decode-side request of a prefill/decode handoff gets blocks for its whole prompt and waits
   for the KV pull (``transfers``) without spending budget.
4. With lower KV tiers (``tiers``: host memory, the shared pool), a fresh request whose prefix
   continues past the GPU hit in a lower tier gets blocks for what it will load and waits for
   the load (``loads``), as vLLM's KV connectors load asynchronously.

The queue order is vLLM's ``--scheduling-policy``: ``fcfs`` (arrival; a preempted request goes
back to the front), or ``priority``: by the request's ``priority`` (lower first), then arrival,
and the running request preempted for KV is the one last in that order, not the last admitted.

``update`` applies the step's result: computed counts advance and full blocks enter the prefix
cache; every request whose computed count reached its token count sampled a token this step.
"""

from __future__ import annotations

import bisect
import contextlib
from collections import deque
from dataclasses import dataclass, field

from backend.kv_manager import KVCacheManager
from backend.kv_tiers import TierWalk
from backend.request import Request, Status


@dataclass(slots=True)
class StepPlan:
    """What one step computes: ``(request, new_tokens, cached_context_before)`` per sequence."""

    scheduled: list[tuple[Request, int, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    transfers: list[Request] = field(default_factory=list)
    loads: list[Request] = field(default_factory=list)  # loading KV from a lower tier
    sampling: int = 0  # sequences that reach their last known token and sample one

    def add(self, req: Request, n: int) -> None:
        ctx = req.num_computed_tokens
        self.scheduled.append((req, n, ctx))
        if ctx + n >= req.num_tokens:
            self.sampling += 1

    def drop(self, req: Request) -> int:
        """Take ``req`` out of the plan (preempted after it was scheduled): its tokens."""
        for k, (r, n, ctx) in enumerate(self.scheduled):
            if r is req:
                del self.scheduled[k]
                if ctx + n >= req.num_tokens:
                    self.sampling -= 1
                return n
        return 0

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n, _ in self.scheduled)

    @property
    def empty(self) -> bool:
        return not self.scheduled

    def work(self) -> list[tuple[int, int]]:
        return [(n, ctx) for _, n, ctx in self.scheduled]

    def num_sampled(self) -> int:
        return self.sampling


@dataclass(slots=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    block_size: int = 16
    max_loras: int = 0  # distinct LoRA adapters one batch may hold (0: no limit)
    policy: str = "fcfs"  # vLLM's --scheduling-policy: fcfs | priority


POLICIES = ("fcfs", "priority")


def _order(r: Request) -> tuple[int, float]:
    return (r.priority, r.arrival_time)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.tiers: TierWalk | None = None
        if config.policy not in POLICIES:
            raise ValueError(f"unknown scheduling policy {config.policy!r}")
        self.by_priority = config.policy == "priority"

    def add(self, req: Request) -> None:
        req.status = Status.WAITING
        if self.by_priority:
            bisect.insort_right(self.waiting, req, key=_order)
        else:
            self.waiting.append(req)

    def _victim(self) -> Request:
        """The running request to preempt: the last admitted, or under ``priority`` the last
        in priority order."""
        if not self.by_priority:
            return self.running.pop()
        victim = max(self.running, key=_order)
        self.running.remove(victim)
        return victim

    def has_work(self) -> bool:
        return bool(self.running) or any(
            r.status is not Status.WAITING_FOR_REMOTE_KVS for r in self.waiting)

    def schedule(self, now: float) -> StepPlan:
        plan = StepPlan()
        budget = self.config.max_num_batched_tokens
        kv = self.kv

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if n <= 0:
                i += 1
                continue
            scheduled = True
            while not kv.allocate_slots(req, n):
                victim = self._victim()
                self._preempt(victim)
                plan.preempted.append(victim)
                if victim is req:
                    scheduled = False
                    break
                if self.by_priority:
                    i = self.running.index(req)
                    budget += plan.drop(victim)  # it may have been scheduled already
            if not scheduled:
                break
            plan.add(req, n)
            budget -= n
            i += 1

        if plan.preempted:
            return plan

        skipped: list[Request] = []
        loras = {r.lora for r in self.running if r.lora} if self.config.max_loras else set()
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            if req.status is Status.WAITING_FOR_REMOTE_KVS or (
                    req.lora and loras and req.lora not in loras
                    and len(loras) >= self.config.max_loras):
                skipped.append(self.waiting.popleft())  # its adapter would be one too many
                continue
            computed, hit = ([], 0) if req.num_computed_tokens else kv.computed_blocks(req)
            rp = req.remote_prefill
            if rp is not None and not rp.started:
                # Allocate the whole prompt now; the KV arrives by transfer, not compute.
                need = req.num_tokens - hit
                if not kv.allocate_slots(req, need, computed):
                    break
                req.num_computed_tokens = 0
                rp.started = True
                rp.hit_tokens = hit
                skipped.append(self._awaits_kv(req, hit, plan.transfers))
                continue
            if self.tiers is not None and rp is None and not req.num_computed_tokens \
                    and not req.tiers_tried:
                load = self.tiers.plan(req.block_hashes, len(computed),
                                       (req.num_tokens - 1) // self.config.block_size,
                                       req.pool_prefix)
                if load is not None:
                    if not kv.allocate_slots(req, load.blocks * self.config.block_size,
                                             computed):
                        break
                    req.tier_hit = load
                    skipped.append(self._awaits_kv(req, hit, plan.loads))
                    continue
            n = min(req.num_tokens - req.num_computed_tokens - hit, budget)
            if not kv.allocate_slots(req, n, computed):
                break
            self.waiting.popleft()
            if req.num_computed_tokens == 0:
                kv.record_lookup(req, hit)
                req.num_computed_tokens = hit
                if req.num_cached_tokens < 0:
                    req.num_cached_tokens = hit
            if req.first_scheduled_time is None:
                req.first_scheduled_time = now
            req.status = Status.RUNNING
            self.running.append(req)
            if req.lora and self.config.max_loras:
                loras.add(req.lora)
            plan.add(req, n)
            budget -= n
        self.waiting.extendleft(reversed(skipped))
        return plan

    def _awaits_kv(self, req: Request, hit: int, into: list[Request]) -> Request:
        """The head of the queue waits for KV to arrive (a pull or a load), its GPU hit
        counted; it leaves the queue (the caller puts it back behind the others)."""
        self.kv.record_lookup(req, hit)
        req.num_cached_tokens = hit
        req.status = Status.WAITING_FOR_REMOTE_KVS
        into.append(req)
        return self.waiting.popleft()

    def update(self, plan: StepPlan) -> list[Request]:
        """Apply a finished step; return the requests that sampled a token, in batch order."""
        sampled: list[Request] = []
        for req, n, _ in plan.scheduled:
            if req.status is not Status.RUNNING:
                continue  # aborted while the step ran; its blocks were kept until now
            req.num_computed_tokens += n
            self.kv.cache_computed(req, req.num_computed_tokens)
            if req.num_computed_tokens >= req.num_tokens:
                sampled.append(req)
        return sampled

    def remote_kv_ready(self, req: Request, ok: bool) -> None:
        """The decode-side KV pull finished: the request may now be scheduled.

        On success the whole prompt's KV is present but, as in vLLM, the last prompt token is
        recomputed to get the logits of the first output token. On failure the pulled blocks
        are dropped and the request prefills locally (vLLM's ``recompute`` load-failure policy).
        """
        if req.status is not Status.WAITING_FOR_REMOTE_KVS:
            return  # aborted meanwhile
        req.status = Status.WAITING
        if ok:
            req.num_computed_tokens = req.num_prompt_tokens - 1
            self.kv.cache_computed(req, req.num_computed_tokens)
        else:
            self.kv.free(req.request_id)
            req.num_computed_tokens = 0
            if req.remote_prefill is not None:
                req.remote_prefill.failed = True

    def tier_loaded(self, req: Request, blocks: int) -> None:
        """A lower-tier load finished with ``blocks`` blocks past the GPU hit (fewer than
        planned when the pool no longer had them all): they are computed now, and the rest
        of the prompt is computed as usual. Nothing loaded: the request starts afresh."""
        if req.status is not Status.WAITING_FOR_REMOTE_KVS:
            return  # aborted meanwhile
        req.status = Status.WAITING
        hit = req.tier_hit
        req.tier_hit = None
        req.tiers_tried = True
        tokens = (hit.gpu + blocks) * self.config.block_size if hit is not None else 0
        if tokens == 0:
            self.kv.free(req.request_id)
            req.num_computed_tokens = 0
            return
        req.num_computed_tokens = tokens
        req.num_cached_tokens = tokens
        self.kv.cache_computed(req, tokens)

    def finish(self, req: Request, status: Status, *, keep_blocks: bool = False) -> None:
        """Remove a request from the queues and free its blocks (unless the caller keeps them)."""
        if req.status is Status.RUNNING:
            self.running.remove(req)
        elif not req.status.finished:
            with contextlib.suppress(ValueError):
                self.waiting.remove(req)
        req.status = status
        if not keep_blocks:
            self.kv.free(req.request_id)

    def preempt_all(self) -> list[Request]:
        """Drop the KV of every running request (another model needs the memory): each is
        preempted as when its own cache is full, and recomputes when it runs again."""
        victims = list(self.running)
        self.running.clear()
        for req in reversed(victims):
            self._preempt(req)
        return victims

    def _preempt(self, req: Request) -> None:
        self.kv.free(req.request_id)
        req.status = Status.PREEMPTED
        req.num_computed_tokens = 0
        req.tiers_tried = False  # what it computed may be in a lower tier by now
        req.num_preemptions += 1
        self.num_preemptions += 1
        if self.by_priority:
            bisect.insort_left(self.waiting, req, key=_order)
        else:
            self.waiting.appendleft(req)
