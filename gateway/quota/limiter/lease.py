"""Quota leases: a replica takes a slice of each big bucket from the shared store at once and
admits from it locally, so most requests cost no Redis round trip at all.

The shared store stays the only authority: a lease is an ordinary reservation on the shared
bucket (``RateStore.reserve`` of ``chunk`` units, atomic across every bucket renewed in one
call), so what replicas hold is already taken and **admission never exceeds the limit**. A
request is admitted when every bucket it touches has enough leased units here; the buckets
short of it are renewed together, first by a whole chunk, and when the shared bucket cannot
spare one, by exactly what this request lacks (near the limit a lease degrades to a
per-request reservation; only when even that is refused is the request denied).

Settlement stays local: a refund of unused output goes back into the lease, an overrun is
taken from it (and from the shared bucket when the lease is empty). What a replica holds and
does not use is the only *under*-admission, bounded by ``chunk`` per bucket per replica:
leases idle for ``idle_s`` are returned to the shared bucket, and all of them on ``close``.
A replica that dies keeps its leases taken (the bucket refills at its rate).

A bucket whose chunk would not cover ``min_costs_per_chunk`` requests like the one at hand is
not leased (small limits): such a request reserves on the shared store as before. When the
store is unreachable a renewal raises ``StoreUnavailable`` like any reservation, so
``ResilientStore``'s fail-open / fail-closed semantics apply unchanged; leases already held
keep admitting meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from gateway.quota.limiter.bucket import Limit
from gateway.quota.limiter.store import (
    DEFAULT_LIFE_S,
    SETTLE_MARGIN_S,
    BucketState,
    Charge,
    Decision,
    RateStore,
    Reservation,
    StoreStats,
    StoreUnavailable,
)

log = logging.getLogger("tokengate.limiter")


@dataclass(slots=True)
class Lease:
    """Units of one shared bucket held by this replica."""

    balance: float = 0.0
    held: Reservation | None = None  # the shared reservation returns and overruns go to
    shared_remaining: float = 0.0  # the shared bucket's remaining at the last renewal
    reset_s: float = 0.0
    used_at: float = 0.0
    held_at: float = 0.0  # when ``held`` was taken: returns and overruns go to it


@dataclass(slots=True)
class LeaseStats:
    renewals: int = 0
    returns: int = 0
    returned_units: float = 0.0
    local_admits: int = 0
    direct: int = 0  # requests reserved on the shared store (a small bucket among theirs)


class _Applied:
    """Settlement steps applied to leased reservations, so a retried step is not applied
    twice: per open reservation its steps (dropped after its life), and each finished one
    (its ``final`` step applied) for ``SETTLE_MARGIN_S`` more, refusing anything after."""

    def __init__(self) -> None:
        self.open: OrderedDict[str, tuple[float, set[str]]] = OrderedDict()
        self.done: OrderedDict[str, float] = OrderedDict()

    def first(self, rid: str, step: str, now: float, life_s: float) -> bool:
        while self.open and next(iter(self.open.values()))[0] <= now:
            self.open.popitem(last=False)
        while self.done and next(iter(self.done.values())) <= now:
            self.done.popitem(last=False)
        if rid in self.done:
            return False
        until, steps = self.open.get(rid) or (now + life_s, set())
        if step in steps:
            return False
        if step == "final":
            self.open.pop(rid, None)
            self.done[rid] = now + SETTLE_MARGIN_S
        else:
            steps.add(step)
            self.open[rid] = (until, steps)
        return True


class LeasedStore:
    def __init__(self, shared: RateStore, fraction: float, *, idle_s: float = 2.0,
                 min_costs_per_chunk: float = 4.0, clock: Callable[[], float] = time.monotonic
                 ) -> None:
        if not 0.0 < fraction <= 0.5:
            raise ValueError("a lease is a fraction of a bucket in (0, 0.5]")
        self.shared = shared
        self.stats: StoreStats = shared.stats  # the shared store's round trips
        self.fraction = fraction
        self.idle_s = idle_s
        self.min_costs_per_chunk = min_costs_per_chunk
        self._clock = clock
        self.leases: dict[tuple[str, str], Lease] = {}
        self.lease_stats = LeaseStats()
        self._applied = _Applied()
        self._lock = asyncio.Lock()
        self._ids = itertools.count()
        self._direct: set[str] = set()  # reservations made on the shared store as they are
        self._reaper: asyncio.Task[None] | None = None

    def chunk(self, limit: Limit) -> float:
        return limit.burst * self.fraction

    # -- admission --------------------------------------------------------------------------
    async def reserve(self, charges: Sequence[Charge], reservation_id: str, *,
                      life_s: float = DEFAULT_LIFE_S, optional: Sequence[Charge] = ()
                      ) -> Decision:
        """Optional charges are leased like the others while their buckets can spare a
        chunk (else just what this request lacks); a bucket that cannot leaves them out."""
        self._start_reaper()
        if not all(self._leasable(c) for c in (*charges, *optional)):
            return await self._direct_reserve(charges, reservation_id, life_s, optional)
        every = (*charges, *optional)
        decided = self._take(every, reservation_id, life_s, len(optional))
        if decided is not None:
            return decided
        async with self._lock:  # renewals one at a time: no two fetch the same shortfall
            whole = True
            for _ in range(4):  # others may spend the leases while a renewal is awaited
                denied = await self._renew(every, whole)
                short = denied.denied if denied is not None else None
                if short is not None and (short.scope, short.limit.kind) in \
                        {c.key for c in optional}:
                    if whole:
                        whole = False  # the optional bucket cannot spare a chunk: the shortfall
                    else:
                        optional, every, whole = (), tuple(charges), True  # nor that: left out
                    continue
                if denied is not None:
                    if not whole:
                        return denied  # the shared bucket cannot cover even this request
                    refused = self._refusal(every, denied)
                    if refused is not None:
                        return refused  # nor would it cover the shortfall: no second call
                    whole = False  # it cannot spare a whole chunk: ask for the shortfall
                decided = self._take(every, reservation_id, life_s, len(optional))
                if decided is not None:
                    return decided
        # still short after renewing: reserve it as it is
        return await self._direct_reserve(charges, reservation_id, life_s, optional)

    async def _direct_reserve(self, charges: Sequence[Charge], reservation_id: str,
                              life_s: float, optional: Sequence[Charge]) -> Decision:
        """On the shared store as it is (a small bucket among the request's, or leases still
        short after renewing): settled there too."""
        self.lease_stats.direct += 1
        d = await self.shared.reserve(charges, reservation_id, life_s=life_s, optional=optional)
        if d.allowed:
            self._direct.add(reservation_id)
        return d

    def _refusal(self, charges: Sequence[Charge], d: Decision) -> Decision | None:
        """The request's own refusal when the bucket that refused a whole chunk has less
        than this request lacks (its retry time for that shortfall), else None."""
        s = d.denied
        if s is None:
            return None
        key = (s.scope, s.limit.kind)
        cost = _per_bucket(charges)[key][1]
        short = cost - self._balance(key)
        if s.remaining + 1e-9 >= short:
            return None
        retry = math.inf if cost > s.limit.burst else (short - s.remaining) * s.limit.interval
        return Decision(False, None, d.states, dataclasses.replace(
            s, requested=cost, retry_after_s=retry))

    def _leasable(self, c: Charge) -> bool:
        """A bucket is leased when a chunk of it covers several requests like this one."""
        return c.cost * self.min_costs_per_chunk <= self.chunk(c.limit)

    def _balance(self, key: tuple[str, str]) -> float:
        lease = self.leases.get(key)
        return lease.balance if lease is not None else 0.0

    def _take(self, charges: Sequence[Charge], rid: str, life_s: float, optional: int = 0
              ) -> Decision | None:
        """Debit every charge from its lease if all have room (no await: atomic here); the
        last ``optional`` of them are the optional ones."""
        for key, (_, cost) in _per_bucket(charges).items():
            if self._balance(key) < cost:
                return None
        now = self._clock()
        states = []
        for c in charges:
            lease = self.leases[c.key]
            lease.balance -= c.cost
            lease.used_at = now
            states.append(BucketState(c.scope, c.limit, lease.shared_remaining + lease.balance,
                                      lease.reset_s, c.cost))
        self.lease_stats.local_admits += 1
        required = len(charges) - optional
        return Decision(True, Reservation(rid, tuple(charges), life_s), tuple(states[:required]),
                        optional=optional > 0)

    async def _renew(self, charges: Sequence[Charge], whole: bool) -> Decision | None:
        """Fetch what the short leases lack (a whole chunk, or just the shortfall) in one
        atomic shared reservation; the shared store's refusal when it has not enough."""
        asks = []
        for key, (c, cost) in _per_bucket(charges).items():
            have = self._balance(key)
            if have >= cost:
                continue
            amount = max(self.chunk(c.limit), cost - have) if whole else cost - have
            asks.append(Charge(c.scope, c.limit, amount))
        if not asks:
            return None
        rid = f"lease-{id(self):x}-{next(self._ids)}"
        d = await self.shared.reserve(asks, rid, life_s=DEFAULT_LIFE_S)
        if not d.allowed or d.reservation is None:
            return d
        self.lease_stats.renewals += 1
        by_key: dict[tuple[str, str], BucketState] = {(s.scope, s.limit.kind): s
                                                      for s in d.states}
        for a in asks:
            lease = self.leases.setdefault(a.key, Lease())
            lease.balance += a.cost
            lease.held = d.reservation
            lease.held_at = self._clock()
            s = by_key.get(a.key)
            if s is not None:
                lease.shared_remaining, lease.reset_s = s.remaining, s.reset_s
        return None

    # -- settlement -------------------------------------------------------------------------
    async def adjust(self, reservation: Reservation, deltas: Mapping[tuple[str, str], float],
                     step: str) -> bool:
        if reservation.id in self._direct:
            if step == "final":
                self._direct.discard(reservation.id)
            return await self.shared.adjust(reservation, deltas, step)
        if not self._applied.first(reservation.id, step, self._clock(), reservation.life_s):
            return False
        owed: dict[tuple[str, str], float] = {}
        for key, delta in deltas.items():
            lease = self.leases.get(key)
            if lease is None:
                continue  # not a bucket of this reservation
            lease.balance -= delta  # a refund (delta < 0) goes back into the lease
            if lease.balance < 0:
                owed[key] = -lease.balance  # an overrun past the lease: the shared bucket's
                lease.balance = 0.0
        for key, units in owed.items():
            held = self.leases[key].held
            if held is not None:
                await self.shared.adjust(held, {key: units}, f"overrun-{next(self._ids)}")
        return True

    async def peek(self, charges: Sequence[Charge]) -> list[BucketState]:
        """The shared buckets (what this replica leased is spent there already)."""
        return await self.shared.peek(charges)

    async def lift(self, charges: Sequence[Charge]) -> int:
        """The shared buckets (what this replica leased is in use there already)."""
        return await self.shared.lift(charges)

    # -- giving back -------------------------------------------------------------------------
    def _start_reaper(self) -> None:
        if self._reaper is None or self._reaper.done():
            with contextlib.suppress(RuntimeError):
                self._reaper = asyncio.get_running_loop().create_task(self._reap())

    async def _reap(self) -> None:
        while True:
            await asyncio.sleep(self.idle_s / 2)
            with contextlib.suppress(StoreUnavailable):
                await self.give_back(idle_only=True)

    async def give_back(self, idle_only: bool = False) -> float:
        """Return leased units to the shared buckets (those idle for ``idle_s``, or all). A
        lease held for half its reservation's life goes back too, busy or not (the next
        request renews it): returns and overruns must reach the shared store while the
        reservation they are settled against is still remembered there."""
        now = self._clock()
        back = 0.0
        # a snapshot: a renewal awaited meanwhile may add leases
        for key, lease in list(self.leases.items()):
            if lease.balance <= 0 or lease.held is None:
                continue
            old = now - lease.held_at >= lease.held.life_s / 2
            if idle_only and now - lease.used_at < self.idle_s and not old:
                continue
            units, lease.balance = lease.balance, 0.0
            try:
                await self.shared.adjust(lease.held, {key: -units}, f"return-{next(self._ids)}")
            except StoreUnavailable:
                lease.balance += units  # still ours: try again later
                raise
            self.lease_stats.returns += 1
            self.lease_stats.returned_units += units
            back += units
        return back

    async def close(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
        try:
            await self.give_back()
        except StoreUnavailable as exc:
            log.warning("could not return quota leases (%s): they stay taken", exc)
        await self.shared.close()


def _per_bucket(charges: Sequence[Charge]) -> dict[tuple[str, str], tuple[Charge, float]]:
    """Each bucket a request touches: one of its charges there, and their total cost."""
    out: dict[tuple[str, str], tuple[Charge, float]] = {}
    for c in charges:
        prev = out.get(c.key)
        out[c.key] = (c, c.cost + (prev[1] if prev is not None else 0.0))
    return out
