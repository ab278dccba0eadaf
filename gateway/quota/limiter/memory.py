"""In-process RateStore on the GCRA arithmetic (single replica; the embedded default)."""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Mapping, Sequence

from gateway.quota.limiter import bucket
from gateway.quota.limiter.store import (
    DEFAULT_LIFE_S,
    BucketState,
    Charge,
    Decision,
    Reservation,
    StoreStats,
)


class MemoryStore:
    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._tat: dict[tuple[str, str], float] = {}
        self._applied: set[tuple[str, str]] = set()  # (reservation, step) applied
        self._expiry: list[tuple[float, tuple[str, str]]] = []  # heap of (when, mark)
        self.stats = StoreStats()

    async def reserve(self, charges: Sequence[Charge], reservation_id: str, *,
                      life_s: float = DEFAULT_LIFE_S, optional: Sequence[Charge] = ()
                      ) -> Decision:
        return self.reserve_now(charges, reservation_id, self._clock(), life_s, optional)

    def reserve_now(self, charges: Sequence[Charge], reservation_id: str, now: float,
                    life_s: float = DEFAULT_LIFE_S, optional: Sequence[Charge] = ()
                    ) -> Decision:
        """The synchronous core (also the local fallback of the Redis store)."""
        self.stats.round_trips += 1
        pending: dict[tuple[str, str], float] = {}
        for c in charges:
            tat = pending.get(c.key, self._tat.get(c.key, 0.0))
            r = bucket.check(tat, now, c.cost, c.limit)
            if not r.allowed:
                states = tuple(self._state(x, now) for x in charges)
                denied = BucketState(c.scope, c.limit, bucket.remaining(tat, now, c.limit),
                                     bucket.reset_after(tat, now), c.cost, r.retry_after_s)
                return Decision(False, None, states, denied)
            pending[c.key] = r.new_tat
        took, taken = bool(optional), dict(pending)
        for c in optional:
            r = bucket.check(taken.get(c.key, self._tat.get(c.key, 0.0)), now, c.cost, c.limit)
            if not r.allowed:
                took = False
                break
            taken[c.key] = r.new_tat
        if took:
            pending = taken
        self._tat.update(pending)
        states = tuple(self._state(c, now) for c in charges)
        held = (*charges, *optional) if took else tuple(charges)
        return Decision(True, Reservation(reservation_id, held, life_s), states, optional=took)

    async def adjust(self, reservation: Reservation, deltas: Mapping[tuple[str, str], float],
                     step: str) -> bool:
        return self.adjust_now(reservation, deltas, step, self._clock())

    def adjust_now(self, reservation: Reservation, deltas: Mapping[tuple[str, str], float],
                   step: str, now: float) -> bool:
        self.stats.round_trips += 1
        self._expire(now)
        mark = (reservation.id, step)
        if mark in self._applied:
            return False
        self._applied.add(mark)
        heapq.heappush(self._expiry, (now + reservation.life_s, mark))
        limits = {c.key: c.limit for c in reservation.charges}
        for key, delta in deltas.items():
            self._tat[key] = bucket.adjust(self._tat.get(key, 0.0), now, delta, limits[key])
        return True

    async def peek(self, charges: Sequence[Charge]) -> list[BucketState]:
        now = self._clock()
        return [self._state(c, now) for c in charges]

    async def lift(self, charges: Sequence[Charge]) -> int:
        now, raised = self._clock(), 0
        for c in charges:
            tat = self._tat.get(c.key, 0.0)
            new = bucket.lift(tat, now, c.cost, c.limit)
            if new > tat:
                self._tat[c.key] = new
                raised += 1
        return raised

    def _state(self, c: Charge, now: float) -> BucketState:
        tat = self._tat.get(c.key, 0.0)
        return BucketState(c.scope, c.limit, bucket.remaining(tat, now, c.limit),
                           bucket.reset_after(tat, now), c.cost)

    def _expire(self, now: float) -> None:
        """Forget the marks past their reservation's life: amortised O(log n) per mark (each
        is pushed and popped once), never a scan of them all."""
        heap = self._expiry
        while heap and heap[0][0] <= now:
            self._applied.discard(heapq.heappop(heap)[1])

    async def close(self) -> None:
        return None
