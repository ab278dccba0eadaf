"""Which waiting request goes next when the fleet is saturated: pure data and arithmetic, the
same for ``serve``, the EPP and the simulator (no clock, no I/O).

Requests wait in *flows* (a tenant, or finer when the request names one: ``x-fairness-id``,
an agent session). The order:

1. **priority band** first, strictly: critical, then reserved (standard requests within their
   tenant's reserved throughput), then standard, then flex;
2. within a band, by the ``mode``:

   * ``fcfs``: arrival order, flows ignored (what an engine's own queue does);
   * ``priority``: bands, then arrival order;
   * ``round_robin``: bands, then one request per backlogged flow in turn (llm-d's default
     fairness policy within a band);
   * ``fair``: bands, then the backlogged flow with the least *virtual service* (VTC, Sheng et
     al., OSDI 2024): each flow's counter grows by ``(w_in·input + w_out·output) / weight``
     for the tokens it is served (input when it is dispatched, output as reserved then, made
     exact when it settles), and a flow that becomes backlogged is lifted to the least
     counter among the backlogged (or to the counter of the flow that left last when none
     is), so an idle flow cannot bank credit;
3. within a flow, earliest deadline first (the request's TTFT SLO after its arrival; arrival
   order among requests without one); among flows with equal counters, one just lifted goes
   first (lifted to the least-served waiting flow's counter, it would otherwise wait behind
   that flow's older requests).

VTC's bound: between two flows that are backlogged over an interval, the difference in
weighted service stays within ``2·U``, ``U = w_in·L_in + w_out·L_out`` for the longest
request (Theorem 4.4 of the paper), here ``vtc_bound``.

Bounded: at ``max_queued`` requests, a new one sheds the worst waiting request, which may be
itself: in the lowest band (flex first), the flow with the longest queue (then the most
served), its latest deadline.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

Mode = Literal["fcfs", "priority", "round_robin", "fair"]
MODES: tuple[Mode, ...] = ("fcfs", "priority", "round_robin", "fair")
BANDS = ("critical", "reserved", "standard", "flex")
_BAND_RANK = {b: i for i, b in enumerate(BANDS)}
_seq = itertools.count()
FORGET_EVERY = 256  # flows becoming backlogged between sweeps of idle flows' counters


def engine_priority(band: str, backlogged: bool) -> int:
    """The ``priority`` an engine running vLLM's priority policy gets (lower first): by band,
    and within a band a request whose flow still has others waiting in the gateway (a flow
    using more than its share) behind the requests of flows that have none. With nothing
    waiting it is the band's alone, so the engine's order within a band stays arrival."""
    return 2 * BANDS.index(band) + (1 if backlogged else 0)


def vtc_bound(w_in: float, w_out: float, max_input: float, max_output: float) -> float:
    """``2·U``, ``U = w_in·L_in + w_out·L_out`` for the longest request (Theorem 4.4)."""
    return 2.0 * (w_in * max_input + w_out * max_output)


@dataclass(slots=True, eq=False)
class Waiter:
    """One waiting request. ``cost_in``/``cost_out``: its prompt and reserved output tokens;
    ``payload``: whatever the caller needs to wake it (a future)."""

    flow: str
    band: str
    deadline: float
    cost_in: float
    cost_out: float
    weight: float = 1.0
    payload: Any = None
    seq: int = field(default_factory=lambda: next(_seq))
    queued: bool = False

    def key(self) -> tuple[float, int]:
        return (self.deadline, self.seq)


@dataclass(slots=True)
class _Flow:
    heap: list[tuple[float, int, Waiter]] = field(default_factory=list)
    live: int = 0  # waiters in the heap still queued (removed ones are skipped lazily)


class FairQueue:
    def __init__(self, mode: Mode = "fair", *, max_queued: int = 1024, w_in: float = 1.0,
                 w_out: float = 2.0) -> None:
        if mode not in MODES:
            raise ValueError(f"unknown flow-control mode {mode!r}")
        self.mode = mode
        self.max_queued = max_queued
        self.w_in, self.w_out = w_in, w_out
        self.counters: dict[str, float] = {}  # virtual service per flow (weighted, /weight)
        # every change to the counters since ``take_deltas`` (charges and lifts): what a
        # replica adds to the counters it shares with the others (``gateway.flow.share``)
        self.deltas: dict[str, float] = {}
        self._bands: dict[str, dict[str, _Flow]] = {b: {} for b in BANDS}
        self._rr: dict[str, list[str]] = {b: [] for b in BANDS}  # round-robin order
        self._last_left = 0.0  # counter of the flow that left the backlog last
        # flows lifted when they became backlogged, not served since: among flows with equal
        # counters they go first (a lifted flow ties with the one it was lifted to)
        self._fresh: set[str] = set()
        self._pushes = 0
        self.size = 0

    # -- service accounting ---------------------------------------------------------------
    def service(self, cost_in: float, cost_out: float, weight: float) -> float:
        return (self.w_in * cost_in + self.w_out * cost_out) / max(weight, 1e-9)

    def charge(self, flow: str, cost_in: float, cost_out: float, weight: float = 1.0) -> None:
        """``flow`` was served (or, negative, refunded) these tokens."""
        self._add(flow, self.service(cost_in, cost_out, weight))

    def _add(self, flow: str, amount: float) -> None:
        self.counters[flow] = self.counters.get(flow, 0.0) + amount
        self.deltas[flow] = self.deltas.get(flow, 0.0) + amount

    def take_deltas(self) -> dict[str, float]:
        """The changes since the last call (to send to the shared counters)."""
        out, self.deltas = self.deltas, {}
        return out

    def give_back(self, deltas: dict[str, float]) -> None:
        """Changes that could not be sent: keep them for the next try."""
        for f, v in deltas.items():
            self.deltas[f] = self.deltas.get(f, 0.0) + v

    def adopt(self, shared: dict[str, float]) -> None:
        """The counters all replicas together have reached (what was last sent included),
        plus what this replica changed since: the counters it orders by from now on."""
        for f in set(shared) | set(self.counters):
            self.counters[f] = shared.get(f, 0.0) + self.deltas.get(f, 0.0)
        self._forget_idle()

    def _floor(self) -> float:
        """What a flow becoming backlogged is lifted to (at least)."""
        waiting = [self.counters.get(f, 0.0) for f in self.backlogged()]
        return min(waiting) if waiting else self._last_left

    def _forget_idle(self) -> None:
        """Drop the counters of idle flows at or below the floor: one would be lifted to
        the floor on its return, as if it had none, so ordering is unchanged and the
        counters stay as many as the flows above it (flow ids may come from clients)."""
        floor, waiting = self._floor(), self.backlogged()
        for f in [f for f, c in self.counters.items() if c <= floor and f not in waiting]:
            del self.counters[f]
            self._fresh.discard(f)

    def bound(self, max_input: float, max_output: float) -> float:
        """VTC's bound on the weighted service difference between backlogged flows."""
        return vtc_bound(self.w_in, self.w_out, max_input, max_output)

    def backlogged(self) -> set[str]:
        """Flows with a request waiting (a flow leaves ``_bands`` with its last one)."""
        return {f for flows in self._bands.values() for f in flows}

    # -- queueing ---------------------------------------------------------------------------
    def push(self, w: Waiter) -> Waiter | None:
        """Queue ``w``; returns the waiter shed to make room (possibly ``w`` itself), or None."""
        if w.band not in _BAND_RANK:
            raise ValueError(f"unknown band {w.band!r}")
        shed: Waiter | None = None
        if self.size >= self.max_queued:
            worst = self._worst()
            if worst is None or self._worse(w, worst):
                return w
            self.remove(worst)
            shed = worst
        if self.mode == "fair" and w.flow not in self.backlogged():
            if self._pushes % FORGET_EVERY == 0:
                self._forget_idle()
            self._pushes += 1
            floor = self._floor()
            own = self.counters.get(w.flow, 0.0)
            if floor > own:
                self._add(w.flow, floor - own)
                self._fresh.add(w.flow)
        flows = self._bands[w.band]
        q = flows.get(w.flow)
        if q is None:
            q = flows[w.flow] = _Flow()
            self._rr[w.band].append(w.flow)
        heapq.heappush(q.heap, (*w.key(), w))
        q.live += 1
        w.queued = True
        self.size += 1
        return shed

    def remove(self, w: Waiter) -> None:
        """``w`` stops waiting (it gave up, timed out or was shed); no-op when not queued."""
        if not w.queued:
            return
        w.queued = False
        self.size -= 1
        q = self._bands[w.band][w.flow]
        q.live -= 1
        self._tidy(w.band, w.flow, q)

    def peek(self) -> Waiter | None:
        """The request that would go next."""
        for band in BANDS:
            flows = self._bands[band]
            if not flows:
                continue
            if self.mode == "fcfs":
                return min((self._head(q) for b in BANDS for q in self._bands[b].values()),
                           key=lambda w: w.seq, default=None)
            if self.mode == "priority":
                return min((self._head(q) for q in flows.values()), key=lambda w: w.seq)
            if self.mode == "round_robin":
                return self._head(flows[self._rr[band][0]])
            return min((self._head(q) for q in flows.values()),
                       key=lambda w: (self.counters.get(w.flow, 0.0), w.flow not in self._fresh,
                                      w.deadline, w.seq))
        return None

    def pop(self) -> Waiter | None:
        """Take the next request off the queue (the caller dispatches it and ``charge``s)."""
        w = self.peek()
        if w is None:
            return None
        if self.mode == "round_robin":
            order = self._rr[w.band]
            order.append(order.pop(0))
        self._fresh.discard(w.flow)
        self.remove(w)
        return w

    # -- internals ----------------------------------------------------------------------------
    @staticmethod
    def _head(q: _Flow) -> Waiter:
        while not q.heap[0][2].queued:
            heapq.heappop(q.heap)
        return q.heap[0][2]

    def _tidy(self, band: str, flow: str, q: _Flow) -> None:
        while q.heap and not q.heap[0][2].queued:
            heapq.heappop(q.heap)
        if len(q.heap) > 2 * q.live + 16:  # requests that left from inside the heap
            q.heap = [e for e in q.heap if e[2].queued]
            heapq.heapify(q.heap)
        if q.live == 0:
            del self._bands[band][flow]
            self._rr[band].remove(flow)
            if not any(flow in flows for flows in self._bands.values()):
                self._last_left = self.counters.get(flow, 0.0)

    def _worse(self, a: Waiter, b: Waiter) -> bool:
        """Is ``a`` a worse candidate to keep than ``b``?"""
        return self._shed_key(a) > self._shed_key(b)

    def _shed_key(self, w: Waiter) -> tuple[int, int, float, float, int]:
        # the longest queue loses first (as fair queueing drops from the fattest flow: a
        # light flow's counter may sit just above a flooder's), then the most served
        q = self._bands[w.band].get(w.flow)
        return (_BAND_RANK[w.band], q.live if q else 0, self.counters.get(w.flow, 0.0),
                w.deadline, w.seq)

    def _worst(self) -> Waiter | None:
        for band in reversed(BANDS):
            flows = self._bands[band]
            if flows:
                return max((w for q in flows.values() for _, _, w in q.heap if w.queued),
                           key=self._shed_key)
        return None

    def has_waiting(self, flow: str, band: str) -> bool:
        """Does ``flow`` have requests waiting in ``band``?"""
        q = self._bands[band].get(flow)
        return q is not None and q.live > 0

    def waiting_by_flow(self) -> dict[str, int]:
        """Requests waiting per flow (all bands)."""
        out: dict[str, int] = {}
        for flows in self._bands.values():
            for flow, q in flows.items():
                if q.live:
                    out[flow] = out.get(flow, 0) + q.live
        return out

    def waiting(self) -> Mapping[str, int]:
        """Requests waiting per band."""
        return {b: sum(q.live for q in flows.values()) for b, flows in self._bands.items()}
