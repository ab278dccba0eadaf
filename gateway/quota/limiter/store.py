"""The RateStore contract: reserve on every bucket a request touches, all or nothing; settle.

A *charge* debits one bucket (a scope's limit of one kind) by a cost. ``reserve`` admits a set
of charges atomically: either every bucket had room and all were debited, or none was, and the
decision names the bucket that refused (its limit, what it had used, what was asked, when to
retry). *Optional* charges ride the same call: taken, all of them, only when the request is
admitted and they have room too, never a reason to refuse (a reserved-throughput tier bucket:
the request is ``reserved`` when it fits, ``payg`` when not); once taken they are ordinary
charges of the reservation, settled with it. ``adjust`` applies after-the-fact deltas to a
reservation's buckets (refunds of unused output, charges of overruns, progressive charges of
long streams); each ``(reservation, step)`` is applied at most once, so retries cannot
double-count. Every store also reports, per bucket touched, what is left and when it is full
again, for the ``x-ratelimit-*`` headers.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from gateway.quota.limiter.bucket import Limit


@dataclass(frozen=True, slots=True)
class Charge:
    scope: str  # e.g. "tenant:acme", "tenant:acme|model:gpt", "model:gpt", "route:default"
    limit: Limit
    cost: float

    @property
    def key(self) -> tuple[str, str]:
        return self.scope, self.limit.kind


@dataclass(frozen=True, slots=True)
class BucketState:
    """One bucket after a decision: for headers and 429 messages."""

    scope: str
    limit: Limit
    remaining: float
    reset_s: float
    requested: float = 0.0
    retry_after_s: float = 0.0

    @property
    def used(self) -> float:
        return max(0.0, self.limit.burst - self.remaining)


# How long a reservation may stay unsettled when the caller does not say: the default route's
# whole life (hold 60 s + queue 0.5 s + total 600 s) plus ``SETTLE_MARGIN_S``.
SETTLE_MARGIN_S = 60.0
DEFAULT_LIFE_S = 660.5 + SETTLE_MARGIN_S


@dataclass(frozen=True, slots=True)
class Reservation:
    id: str
    charges: tuple[Charge, ...]
    # The longest the request may take to be settled: its idempotency markers live this long
    # (they only need to outlive the last settlement step), so their number in Redis is
    # bounded by the request rate times this, not by a day of requests.
    life_s: float = DEFAULT_LIFE_S
    # how many of the last charges were optional and may not have been taken: only a
    # reservation whose answer was lost has any (voiding it gives back those only if taken)
    optional: int = 0


@dataclass(frozen=True, slots=True)
class Decision:
    allowed: bool
    reservation: Reservation | None
    states: tuple[BucketState, ...] = ()  # the required charges' buckets
    denied: BucketState | None = None
    optional: bool = False  # the optional charges were taken (in ``reservation.charges``)


@dataclass(slots=True)
class StoreStats:
    round_trips: int = 0
    fallbacks: int = 0  # decisions served by a local limiter because the store was unreachable
    owed: int = 0  # calls whose outcome was lost, waiting to be made good (voids, steps)
    compensated: int = 0  # such calls made good since start
    abandoned: int = 0  # such calls given up on: the store stayed away past their life


class RateStore(Protocol):
    stats: StoreStats

    async def reserve(self, charges: Sequence[Charge], reservation_id: str, *,
                      life_s: float = DEFAULT_LIFE_S, optional: Sequence[Charge] = ()
                      ) -> Decision:
        """All of ``charges`` or none; then all of ``optional`` if they have room."""
        ...

    async def adjust(self, reservation: Reservation, deltas: Mapping[tuple[str, str], float],
                     step: str) -> bool:
        """Apply ``deltas`` (by ``Charge.key``) once per ``step``; False if already applied."""
        ...

    async def peek(self, charges: Sequence[Charge]) -> list[BucketState]:
        """The buckets' state now, charging nothing (``/admin/limiter``)."""
        ...

    async def lift(self, charges: Sequence[Charge]) -> int:
        """Bring each bucket to at least ``cost`` units in use (what a ledger says was spent
        in it), never lower one; returns how many were raised."""
        ...

    async def close(self) -> None: ...


class StoreUnavailable(RuntimeError):
    """The backing store could not be reached."""


@dataclass(slots=True)
class Settlement:
    """Tracks what a reservation has been charged so far, to settle it exactly once."""

    reservation: Reservation
    charged: dict[tuple[str, str], float] = field(default_factory=dict)
    steps: int = 0
    final: bool = False
    in_flight: set[asyncio.Future[bool]] = field(default_factory=set)  # progressive charges

    def __post_init__(self) -> None:
        for c in self.reservation.charges:
            self.charged[c.key] = self.charged.get(c.key, 0.0) + c.cost

    def deltas_to(self, totals: Mapping[str, float]) -> dict[tuple[str, str], float]:
        """Deltas that bring every bucket to ``totals[kind]`` (kinds absent stay as they are)."""
        out = {}
        for (scope, kind), have in self.charged.items():
            if kind in totals:
                d = totals[kind] - have
                if d:
                    out[(scope, kind)] = d
        return out

    def record(self, deltas: Mapping[tuple[str, str], float]) -> None:
        for k, d in deltas.items():
            self.charged[k] += d
