"""GCRA (generic cell rate algorithm) leaky-bucket arithmetic: the reference semantics.

A bucket admits ``amount`` units per ``period_s`` and can hold up to ``burst`` units of credit.
Its whole state is one number, the theoretical arrival time (TAT): the moment the bucket would
be full again if nothing more arrived. Each unit costs ``interval = period_s / amount`` seconds
of TAT; a request of ``cost`` units is admitted when ``max(TAT, now) + cost·interval`` does not
run more than ``tolerance = burst·interval`` ahead of ``now``. Settling adds or removes
``delta·interval`` (a refund never gives more credit than a full bucket). Every function here
is pure: state and ``now`` in, new state out; the stores call exactly these.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

Kind = Literal["requests", "tokens", "tokens_day", "budget", "budget_daily", "budget_monthly",
               "session_budget"]
KINDS: tuple[Kind, ...] = ("requests", "tokens", "tokens_day", "budget", "budget_daily",
                           "budget_monthly", "session_budget")
# A calendar budget (or a session's cap) is a bucket that does not refill within its window
# and whose scope names the window (``gateway.quota.calendar``): the next window is a new,
# full bucket. Each unit (dollar) costs the same ``NO_REFILL_S`` of TAT whatever the cap, so
# the state holds what was spent, not a fraction of the cap: a cap raised or lowered by a
# reload changes the cap, never the spend (a cap lowered below the spend refuses at once).
NO_REFILL_S = 1e13


@dataclass(frozen=True, slots=True)
class Limit:
    """``amount`` units per ``period_s`` with at most ``burst`` units of accumulated credit."""

    kind: Kind
    amount: float
    period_s: float
    burst: float
    # a calendar window's end (epoch seconds): it resets then, and its state may go after it
    expires_at: float | None = None

    def __post_init__(self) -> None:
        if self.amount <= 0 or self.period_s <= 0 or self.burst <= 0:
            raise ValueError("a limit needs a positive amount, period and burst")

    @property
    def interval(self) -> float:
        return self.period_s / self.amount

    @property
    def tolerance(self) -> float:
        return self.burst * self.interval


def spend_cap(kind: Kind, cap: float, expires_at: float | None = None) -> Limit:
    """A cap of ``cap`` units that does not refill (``NO_REFILL_S`` seconds of TAT a unit)."""
    return Limit(kind, cap, cap * NO_REFILL_S, cap, expires_at=expires_at)


@dataclass(frozen=True, slots=True)
class Check:
    allowed: bool
    new_tat: float  # the TAT if admitted (unchanged state when denied)
    retry_after_s: float  # 0 when allowed; inf when the cost exceeds the burst


def check(tat: float, now: float, cost: float, limit: Limit) -> Check:
    """Would a request of ``cost`` units be admitted at ``now``?"""
    if cost > limit.burst:
        return Check(False, tat, math.inf)
    new_tat = max(tat, now) + cost * limit.interval
    allow_at = new_tat - limit.tolerance
    if allow_at > now:
        return Check(False, tat, allow_at - now)
    return Check(True, new_tat, 0.0)


def adjust(tat: float, now: float, delta: float, limit: Limit) -> float:
    """Charge (``delta`` > 0) or refund (``delta`` < 0) units after the fact."""
    new_tat = max(tat, now) + delta * limit.interval
    return max(new_tat, now) if delta < 0 else new_tat


LIFT_SLACK_UNITS = 1e-6  # a lift short of this many units changes nothing


def lift(tat: float, now: float, used: float, limit: Limit) -> float:
    """The state of a bucket that has at least ``used`` units in use now (a ledger's count):
    raised to it when below by more than ``LIFT_SLACK_UNITS``, unchanged otherwise (so that
    lifting twice to the same count changes nothing, however much time passed in between:
    a spend cap refills by a unit in ``NO_REFILL_S``)."""
    floor = now + used * limit.interval
    return floor if floor - tat > LIFT_SLACK_UNITS * limit.interval else tat


def remaining(tat: float, now: float, limit: Limit) -> float:
    """Units that could be admitted now."""
    return max(0.0, (limit.tolerance - (max(tat, now) - now)) / limit.interval)


def reset_after(tat: float, now: float) -> float:
    """Seconds until the bucket is full again."""
    return max(0.0, tat - now)
