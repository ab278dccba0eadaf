"""Which waiting request goes next when the fleet is saturated: pure data and arithmetic, the
same for ``serve``, the EPP and the simulator (no clock, no I/O).

Requests wait in *flows*. A flow is a tenant, divided, when a request names one, into
sub-flows (``tenant/ID``: ``x-fairness-id``, an agent session). Sub-flows divide their
tenant's share; they never add to it: however many ids a tenant sends, it competes with the
other tenants as one flow. The order:

1. **priority band** first, strictly: critical, then reserved (standard requests within their
   tenant's reserved throughput), then standard, then flex;
2. within a band, between tenants, by the ``mode``:

   * ``fcfs``: arrival order, flows ignored (what an engine's own queue does);
   * ``priority``: bands, then arrival order;
   * ``round_robin``: bands, then one request per backlogged tenant in turn (llm-d's default
     fairness policy within a band);
   * ``fair``: bands, then the backlogged tenant with the least *virtual service* (VTC, Sheng
     et al., OSDI 2024): each tenant's counter grows by ``(w_in·input + w_out·output) /
     weight`` for the tokens it is served (input when it is dispatched, output as reserved
     then, made exact when it settles), and a tenant that becomes backlogged is *lifted* to
     the least counter among the backlogged (or to the counter of the tenant that left last
     when none is): its counter becomes ``max(own, floor)``, so idling banks no credit;
3. within a tenant, the sub-flow with the least service within the tenant (the same counter,
   kept per replica and lifted the same way), then earliest deadline first (the request's
   TTFT SLO after its arrival; arrival order among requests without one); among tenants with
   equal counters, one just lifted goes first (lifted to the least-served waiting tenant's
   counter, it would otherwise wait behind that tenant's older requests).

Sub-flows, their counters and their bound (``max_subflows`` waiting per tenant) are kept by
``gateway.flow.subflows``.

Counters shared by replicas (``gateway.flow.share``) are the tenants' only. What a replica
changed since its last exchange is a ``Delta``: charges and lifts composed exactly
(``max(x + before, lift) + after``), so a lift is never *added* to what the other replicas
counted.

The bound (Theorem in §4 of the paper): between two tenants backlogged over an interval, the
difference in weighted service stays within ``2·max(w_in·L_in, w_out·M)``, ``L_in`` the longest
prompt and ``M`` the most tokens one running batch holds (``vtc_bound``). Replicas add what the
others serve within one exchange interval (``gateway.flow.share``).

Bounded: at ``max_queued`` requests, a new one sheds the worst waiting request, which may be
itself: in the lowest band (flex first), the tenant with the longest queue (then the most
served), its latest deadline.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator, Mapping, Set
from dataclasses import dataclass, field
from typing import Literal

from gateway.flow.delta import Delta
from gateway.flow.subflows import MAX_SUBFLOWS, SubFlows
from gateway.flow.waiter import BANDS, Waiter, tenant_of

Mode = Literal["fcfs", "priority", "round_robin", "fair"]
MODES: tuple[Mode, ...] = ("fcfs", "priority", "round_robin", "fair")
_BAND_RANK = {b: i for i, b in enumerate(BANDS)}
FORGET_EVERY = 256  # tenants becoming backlogged between sweeps of idle tenants' counters


def vtc_bound(w_in: float, w_out: float, max_input: float, max_batch_tokens: float) -> float:
    """VTC's bound on the weighted service difference between two backlogged flows:
    ``2·max(w_in·L_in, w_out·M)``, ``L_in`` the longest prompt, ``M`` the most tokens a
    running batch holds."""
    return 2.0 * max(w_in * max_input, w_out * max_batch_tokens)


@dataclass(slots=True)
class _Flow:
    heap: list[tuple[float, int, Waiter]] = field(default_factory=list)
    live: int = 0  # waiters in the heap still queued (removed ones are skipped lazily)


@dataclass(slots=True)
class _Tenant:
    """A tenant's waiting requests in one band, by sub-flow."""

    subs: dict[str, _Flow] = field(default_factory=dict)
    live: int = 0


class FairQueue:
    def __init__(self, mode: Mode = "fair", *, max_queued: int = 1024, w_in: float = 1.0,
                 w_out: float = 2.0, max_subflows: int = MAX_SUBFLOWS) -> None:
        if mode not in MODES:
            raise ValueError(f"unknown flow-control mode {mode!r}")
        self.mode = mode
        self.max_queued = max_queued
        self.w_in, self.w_out = w_in, w_out
        self.counters: dict[str, float] = {}  # virtual service per tenant (weighted, /weight)
        # every change to the counters since ``take_deltas`` (charges and lifts): what a
        # replica sends to the counters it shares with the others (``gateway.flow.share``)
        self.deltas: dict[str, Delta] = {}
        self.subs = SubFlows(max_subflows)  # per tenant: its sub-flows' counters
        self._bands: dict[str, dict[str, _Tenant]] = {b: {} for b in BANDS}
        self._rr: dict[str, list[str]] = {b: [] for b in BANDS}  # round-robin order
        self._last_left = 0.0  # counter of the tenant that left the backlog last
        # tenants lifted when they became backlogged, not served since: among tenants with
        # equal counters they go first (a lifted tenant ties with the one it was lifted to)
        self._fresh: set[str] = set()
        self._pushes = 0
        self.size = 0
        # tenants waiting at other replicas (``gateway.flow.share``, each exchange), and how
        # far ahead of them a tenant here may be served (what a replica serves in about one
        # exchange interval)
        self.elsewhere: dict[str, int] = {}  # tenant -> its highest band there (rank)
        self.slack = 0.0

    # -- service accounting ---------------------------------------------------------------
    def service(self, cost_in: float, cost_out: float, weight: float) -> float:
        return (self.w_in * cost_in + self.w_out * cost_out) / max(weight, 1e-9)

    def charge(self, flow: str, cost_in: float, cost_out: float, weight: float = 1.0,
               sub: str | None = None) -> None:
        """``flow`` was served (or, negative, refunded) these tokens: its tenant's counter
        grows by the weighted service, its sub-flow's (``sub``, where it waited; else
        ``flow``) within the tenant by the service."""
        tenant = tenant_of(flow)
        amount = self.service(cost_in, cost_out, weight)
        self.counters[tenant] = self.counters.get(tenant, 0.0) + amount
        self._delta(tenant).add(amount)
        self.subs.charge(tenant, sub or flow, amount * max(weight, 1e-9))

    def _delta(self, tenant: str) -> Delta:
        d = self.deltas.get(tenant)
        if d is None:
            d = self.deltas[tenant] = Delta()
        return d

    def _lift(self, tenant: str, floor: float) -> None:
        own = self.counters.get(tenant, 0.0)
        if floor > own:
            self.counters[tenant] = floor
            self._fresh.add(tenant)
        self._delta(tenant).lift_to(floor)

    def take_deltas(self) -> dict[str, Delta]:
        """The changes since the last call (to send to the shared counters)."""
        out, self.deltas = self.deltas, {}
        return out

    def give_back(self, deltas: dict[str, Delta]) -> None:
        """Changes that could not be sent: kept, before whatever changed since."""
        for f, d in deltas.items():
            newer = self.deltas.get(f)
            self.deltas[f] = d if newer is None else d.then(newer)

    def adopt(self, shared: dict[str, float]) -> None:
        """The counters all replicas together have reached (what was last sent included),
        with what this replica changed since: the counters it orders by from now on."""
        for f in set(shared) | set(self.counters):
            d = self.deltas.get(f)
            base = shared.get(f, 0.0)
            self.counters[f] = d.apply(base) if d is not None else base
        self._forget_idle()

    def inherit(self, old: FairQueue) -> None:
        """Take over ``old``'s counters and what it has not sent yet (a reload)."""
        self.counters.update(old.counters)
        self.give_back(old.take_deltas())
        self.subs.inherit(old.subs)
        self._last_left = old._last_left

    def _floor(self, anywhere: bool = True) -> float:
        """What a tenant becoming backlogged is lifted to (at least): the least counter of
        the tenants waiting here or (``anywhere``) at another replica."""
        waiting = [self.counters.get(t, 0.0)
                   for t in (self.backlogged() | set(self.elsewhere) if anywhere
                             else self.backlogged())]
        return min(waiting) if waiting else self._last_left

    def behind_elsewhere(self, tenant: str, band: str = "standard",
                         but: Set[str] = frozenset()) -> bool:
        """Does a tenant waiting at another replica in ``band`` or a higher one (other than
        those in ``but``) trail ``tenant`` by more than the slack? Then this replica holds
        ``tenant``'s request of ``band`` back and the other takes the room."""
        if not self.elsewhere or self.mode != "fair":
            return False
        mine, rank = self.counters.get(tenant, 0.0) - self.slack, _BAND_RANK[band]
        return any(self.counters.get(t, 0.0) < mine for t, r in self.elsewhere.items()
                   if r <= rank and t != tenant and t not in but)

    def bands_waiting(self) -> dict[str, int]:
        """Each tenant waiting here, with the rank of its highest band (0: critical)."""
        out: dict[str, int] = {}
        for rank, band in enumerate(BANDS):
            for t in self._bands[band]:
                out.setdefault(t, rank)
        return out

    def _forget_idle(self) -> None:
        """Drop the counters of idle tenants at or below the floor: one would be lifted to
        the floor on its return, as if it had none, so ordering is unchanged."""
        floor, waiting = self._floor(anywhere=False), self.backlogged() | set(self.elsewhere)
        for t in [t for t, c in self.counters.items() if c <= floor and t not in waiting]:
            del self.counters[t]
            self._fresh.discard(t)

    def bound(self, max_input: float, max_batch_tokens: float) -> float:
        """VTC's bound on the weighted service difference between backlogged tenants."""
        return vtc_bound(self.w_in, self.w_out, max_input, max_batch_tokens)

    def backlogged(self) -> set[str]:
        """Tenants with a request waiting (a tenant leaves ``_bands`` with its last one)."""
        return {t for tenants in self._bands.values() for t in tenants}

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
        w.tenant = tenant_of(w.flow)
        if self.mode == "fair" and w.tenant not in self.backlogged():
            if self._pushes % FORGET_EVERY == 0:
                self._forget_idle()
            self._pushes += 1
            self._lift(w.tenant, self._floor())
        w.sub = self.subs.enter(w.tenant, w.flow)
        tenants = self._bands[w.band]
        t = tenants.get(w.tenant)
        if t is None:
            t = tenants[w.tenant] = _Tenant()
            self._rr[w.band].append(w.tenant)
        q = t.subs.get(w.sub)
        if q is None:
            q = t.subs[w.sub] = _Flow()
        heapq.heappush(q.heap, (*w.key(), w))
        q.live += 1
        t.live += 1
        w.queued = True
        self.size += 1
        return shed

    def remove(self, w: Waiter) -> None:
        """``w`` stops waiting (it gave up, timed out or was shed); no-op when not queued."""
        if not w.queued:
            return
        w.queued = False
        self.size -= 1
        t = self._bands[w.band][w.tenant]
        q = t.subs[w.sub]
        q.live -= 1
        t.live -= 1
        self.subs.leave(w.tenant, w.sub)
        self._tidy(w.band, w.tenant, w.sub, t, q)

    def peek(self) -> Waiter | None:
        """The request that would go next."""
        for band in BANDS:
            tenants = self._bands[band]
            if not tenants:
                continue
            if self.mode == "fcfs":
                return min((h for b in BANDS for h in self._heads(b)), key=lambda w: w.seq,
                           default=None)
            if self.mode == "priority":
                return min(self._heads(band), key=lambda w: w.seq)
            if self.mode == "round_robin":
                return self._tenant_head(tenants[self._rr[band][0]])
            heads = (self._tenant_head(t) for t in tenants.values())
            return min(heads, key=lambda w: (self.counters.get(w.tenant, 0.0),
                                             w.tenant not in self._fresh, w.deadline, w.seq))
        return None

    def pop(self, head: Waiter | None = None) -> Waiter | None:
        """Take the next request off the queue (the caller dispatches it and ``charge``s);
        ``head``: what ``peek`` just answered, if the caller asked it."""
        w = head or self.peek()
        if w is None:
            return None
        if self.mode == "round_robin":
            order = self._rr[w.band]
            order.append(order.pop(0))
        self.take(w)
        return w

    def take(self, w: Waiter) -> None:
        """Take ``w`` off the queue to be dispatched (out of turn, or as the head)."""
        self._fresh.discard(w.tenant)
        self.remove(w)

    # -- internals ----------------------------------------------------------------------------
    @staticmethod
    def _head(q: _Flow) -> Waiter:
        while not q.heap[0][2].queued:
            heapq.heappop(q.heap)
        return q.heap[0][2]

    def _heads(self, band: str) -> Iterator[Waiter]:
        for t in self._bands[band].values():
            for q in t.subs.values():
                yield self._head(q)

    def _tenant_head(self, t: _Tenant) -> Waiter:
        """The tenant's next request: of its least-served sub-flow, the earliest deadline."""
        if len(t.subs) == 1:
            return self._head(next(iter(t.subs.values())))
        heads = [self._head(q) for q in t.subs.values()]
        sub = self.subs[heads[0].tenant].counters
        return min(heads, key=lambda w: (sub.get(w.sub, 0.0), w.deadline, w.seq))

    def _tidy(self, band: str, tenant: str, sub: str, t: _Tenant, q: _Flow) -> None:
        while q.heap and not q.heap[0][2].queued:
            heapq.heappop(q.heap)
        if len(q.heap) > 2 * q.live + 16:  # requests that left from inside the heap
            q.heap = [e for e in q.heap if e[2].queued]
            heapq.heapify(q.heap)
        if q.live == 0:
            del t.subs[sub]
        if t.live == 0:
            del self._bands[band][tenant]
            self._rr[band].remove(tenant)
            if not any(tenant in tenants for tenants in self._bands.values()):
                self._last_left = self.counters.get(tenant, 0.0)
                self.subs.left_backlog(tenant)

    def _worse(self, a: Waiter, b: Waiter) -> bool:
        """Is ``a`` a worse candidate to keep than ``b``?"""
        return self._shed_key(a) > self._shed_key(b)

    def _shed_key(self, w: Waiter) -> tuple[int, int, float, float, int]:
        # the longest queue loses first (as fair queueing drops from the fattest flow: a
        # light tenant's counter may sit just above a flooder's), then the most served
        t = self._bands[w.band].get(w.tenant or tenant_of(w.flow))
        return (_BAND_RANK[w.band], t.live if t else 0,
                self.counters.get(w.tenant or tenant_of(w.flow), 0.0), w.deadline, w.seq)

    def _worst(self) -> Waiter | None:
        """The waiter ``_shed_key`` puts last: the lowest band's tenant (or tenants, tied)
        with the longest queue and the most service, then its latest deadline. The tenants
        are compared first, so only the worst tenant's waiters are scanned."""
        for band in reversed(BANDS):
            tenants = self._bands[band]
            if tenants:
                counters = self.counters
                top = max((t.live, counters.get(name, 0.0)) for name, t in tenants.items())
                worst = [t for name, t in tenants.items()
                         if (t.live, counters.get(name, 0.0)) == top]
                best: tuple[float, int, Waiter] | None = None
                for t in worst:
                    for q in t.subs.values():
                        if not q.live:
                            continue
                        e = max(q.heap)  # (deadline, seq, waiter): seq decides, in C
                        if not e[2].queued:  # one that left lazily: the queued ones only
                            e = max(x for x in q.heap if x[2].queued)
                        if best is None or e[:2] > best[:2]:
                            best = e
                return best[2] if best is not None else None
        return None

    def has_waiting(self, flow: str, band: str) -> bool:
        """Does ``flow``'s tenant have requests waiting in ``band``?"""
        t = self._bands[band].get(tenant_of(flow))
        return t is not None and t.live > 0

    def head_of(self, tenant: str) -> Waiter | None:
        """``tenant``'s next request (its highest band)."""
        for band in BANDS:
            t = self._bands[band].get(tenant)
            if t is not None:
                return self._tenant_head(t)
        return None

    def waiting_of(self, tenant: str) -> int:
        """Requests ``tenant`` has waiting (all bands)."""
        return self.subs.waiting_of(tenant)

    def waiting_by_flow(self) -> dict[str, int]:
        """Requests waiting per sub-flow (``SubFlows.waiting_by_flow``)."""
        return self.subs.waiting_by_flow()

    def sub_counters(self) -> dict[str, float]:
        """Each remembered sub-flow's service within its tenant (this replica's)."""
        return self.subs.counters()

    def waiting(self) -> Mapping[str, int]:
        """Requests waiting per band."""
        return {b: sum(t.live for t in tenants.values()) for b, tenants in self._bands.items()}
