"""A RateStore that survives its backing store going away.

While the primary (Redis) answers, every call goes to it. When it fails, ``fail_open`` serves
from a local in-memory limiter whose limits are this replica's share (1/replicas) of the real
ones, counts each such decision, and tries the primary again after ``retry_s``; ``fail_closed``
raises ``StoreUnavailable`` (the gateway answers 503). Reservations remember which store made
them, so each is settled where it was made. ``replicas`` is the last count of the replicas
sharing the limits (``gateway.quota.limiter.census`` keeps it); while it is unknown (None: this
replica has not counted them since it started), ``fail_open`` admits nothing locally either.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Mapping, Sequence

from gateway.quota.limiter.memory import MemoryStore
from gateway.quota.limiter.store import (
    DEFAULT_LIFE_S,
    BucketState,
    Charge,
    Decision,
    RateStore,
    Reservation,
    StoreStats,
    StoreUnavailable,
)

log = logging.getLogger("tokengate.limiter")


class Uncounted(StoreUnavailable):
    """The store is away and this replica has never counted the replicas sharing the limits:
    it admits nothing on its own (the message is safe to show a client)."""


class ResilientStore:
    def __init__(self, primary: RateStore, *, fail_open: bool = True,
                 replicas: int | None = 1, retry_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.primary = primary
        self.fail_open = fail_open
        self.replicas: int | None = None if replicas is None else max(1, replicas)
        self.local = MemoryStore()
        self.retry_s = retry_s
        self._clock = clock
        self._down_until = 0.0
        self._local_ids: set[str] = set()
        self.stats = StoreStats()

    @property
    def degraded(self) -> bool:
        return self._clock() < self._down_until

    def counted(self, n: int) -> None:
        """The census's latest count of the replicas sharing the limits."""
        self.replicas = max(1, n)

    def _share(self, charges: Sequence[Charge]) -> list[Charge]:
        if self.replicas is None or self.replicas == 1:
            return list(charges)
        k = 1.0 / self.replicas
        return [dataclasses.replace(c, limit=dataclasses.replace(
            c.limit, amount=c.limit.amount * k, burst=c.limit.burst * k)) for c in charges]

    def _mark_down(self, exc: Exception) -> None:
        if not self.degraded:
            log.warning("rate store unreachable (%s): %s for %.1fs", exc,
                        "serving local limits" if self.fail_open else "refusing requests",
                        self.retry_s)
        self._down_until = self._clock() + self.retry_s

    async def reserve(self, charges: Sequence[Charge], reservation_id: str, *,
                      life_s: float = DEFAULT_LIFE_S, optional: Sequence[Charge] = ()
                      ) -> Decision:
        if not self.degraded:
            try:
                d = await self.primary.reserve(charges, reservation_id, life_s=life_s,
                                               optional=optional)
                self.stats.round_trips += 1
                return d
            except StoreUnavailable as exc:
                self._mark_down(exc)
        if not self.fail_open:
            raise StoreUnavailable("rate store unreachable and the policy says fail_closed")
        if self.replicas is None:
            raise Uncounted("rate limiting is unavailable: the shared rate store has been "
                            "unreachable since this gateway replica started, and without "
                            "having counted the replicas sharing the limits it admits nothing "
                            "on its own")
        self.stats.fallbacks += 1
        d = await self.local.reserve(self._share(charges), reservation_id, life_s=life_s,
                                     optional=self._share(optional))
        if d.allowed:
            self._local_ids.add(reservation_id)
        return d

    async def adjust(self, reservation: Reservation, deltas: Mapping[tuple[str, str], float],
                     step: str) -> bool:
        if reservation.id in self._local_ids:
            # made by the local limiter: its charges are this replica's share already
            if step == "final":
                self._local_ids.discard(reservation.id)
            return await self.local.adjust(reservation, deltas, step)
        try:
            return await self.primary.adjust(reservation, deltas, step)
        except StoreUnavailable as exc:
            # The primary holds this reservation: the adjustment is lost with it. Count it.
            self._mark_down(exc)
            self.stats.fallbacks += 1
            log.warning("could not settle %s (%s): its quota stays as reserved",
                        reservation.id, exc)
            return False

    async def peek(self, charges: Sequence[Charge]) -> list[BucketState]:
        if not self.degraded:
            try:
                return await self.primary.peek(charges)
            except StoreUnavailable as exc:
                self._mark_down(exc)
        return await self.local.peek(self._share(charges))

    async def lift(self, charges: Sequence[Charge]) -> int:
        """The shared buckets only (raises ``StoreUnavailable`` while they are away)."""
        return await self.primary.lift(charges)

    async def close(self) -> None:
        await self.primary.close()
