"""Decode runs: the steps of a fixed decode batch, laid out ahead and applied lazily.

Between two changes to its batch (a sequence finishing, a request arriving, a KV pull
landing) a decode-only engine runs steps that are a pure function of its state: every
sequence computes one token, the step's cost is ``TimingModel.seconds`` of the batch's
totals (context grows by one token per sequence per step), and the only other effects are
a new block when a sequence's last block fills, that block entering the prefix cache, and
the tokens streamed. ``layout`` computes such a run up to the first step that finishes a
sequence or would run out of free blocks (where the scheduler would preempt): its step end
times, and each block allocation and cache registration in the order the step-by-step
engine makes them (by step, allocations before registrations, in batch order), so applying
any prefix of the run leaves the engine exactly as stepping would have. The engine applies
it when something reads or changes its state, and cuts it at the step under way when a new
request can join the batch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from backend.request import Request, Status
from backend.scheduler import Scheduler, StepPlan
from roofline.timing import TimingModel

ALLOC, CACHE = 0, 1


@dataclass(slots=True)
class DecodeRun:
    batch: list[Request]
    c0: list[int]  # computed tokens of each sequence before the run's first step
    ends: list[float]  # ends[j - 1]: when step j ends
    durations: list[float]
    factors: list[float]  # the jitter factor drawn for each step
    events: list[tuple[int, int, int]] = field(default_factory=list)  # (step, kind, seq)
    done: int = 0  # steps applied to the engine's state
    next_event: int = 0  # index in ``events`` of the first not yet applied
    told: int = 0  # steps whose tokens the requests' hooks have been given
    gen: int = 0  # bumped when the run is cut: its old end event is stale

    @property
    def steps(self) -> int:
        return len(self.ends)

    def cut(self, steps: int) -> list[float]:
        """Keep the first ``steps`` steps; return the jitter factors of the dropped ones."""
        dropped = self.factors[steps:]
        del self.ends[steps:], self.durations[steps:], self.factors[steps:]
        while self.events and self.events[-1][0] > steps:
            self.events.pop()
        self.gen += 1
        return dropped


def decode_only(plan: StepPlan, scheduler: Scheduler) -> bool:
    """The plan is one token for every running sequence, each past its first token, and
    nothing waits that a later step could admit."""
    if plan.preempted or plan.transfers or len(plan.scheduled) != len(scheduler.running):
        return False
    if plan.sampling != len(plan.scheduled):
        return False
    for req, n, _ in plan.scheduled:
        if n != 1 or req.num_output_tokens < 1:
            return False
    return all(r.status is Status.WAITING_FOR_REMOTE_KVS for r in scheduler.waiting)


def layout(plan: StepPlan, blocks: Callable[[Request], int], free_blocks: int,
           block_size: int, timing: TimingModel, factor: Callable[[], float],
           start: float) -> DecodeRun | None:
    """The run that begins with ``plan`` (already scheduled: its blocks are allocated) at
    ``start``; None when it would be a single step. ``blocks(req)`` is the length of a
    sequence's block table; ``factor()`` draws the next step's jitter."""
    batch = [r for r, _, _ in plan.scheduled]
    c0 = [ctx for _, _, ctx in plan.scheduled]
    steps = min(min(r.max_tokens, r.target_output_tokens) - r.num_output_tokens for r in batch)
    if steps < 2:
        return None
    bs = block_size
    allocs: list[tuple[int, int, int]] = []
    caches: list[tuple[int, int, int]] = []
    for i, (req, c) in enumerate(zip(batch, c0, strict=True)):
        # step j computes token c + j - 1: it needs a block when that starts a new one
        allocs.extend((j, ALLOC, i) for j in range(blocks(req) * bs - c + 1, steps + 1, bs))
        caches.append((1, CACHE, i))  # step 1 registers whatever filled (usually nothing)
        first = (-c) % bs or bs  # the step after which c + j tokens fill whole blocks
        caches.extend((j, CACHE, i) for j in range(first if first > 1 else first + bs,
                                                   steps + 1, bs))
    allocs.sort()
    if len(allocs) > free_blocks:
        steps = allocs[free_blocks][0] - 1  # that step would preempt: stepping takes it
        if steps < 2:
            return None
    events = sorted(e for e in (*allocs, *caches) if e[0] <= steps)
    n = len(batch)
    total = sum(c0)
    ends: list[float] = []
    durations: list[float] = []
    factors: list[float] = []
    t = start
    for j in range(1, steps + 1):
        kv = total + n * j  # each sequence's context plus its new token
        base = timing.seconds(n, float(kv), kv, n, n)
        f = factor()
        d = base * f
        factors.append(f)
        durations.append(d)
        t = t + d
        ends.append(t)
    return DecodeRun(batch, c0, ends, durations, factors, events)
