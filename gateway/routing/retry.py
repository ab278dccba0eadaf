"""Retries without storms: a per-pool retry budget and jittered exponential backoff.

The budget works like Finagle's ``RetryBudget``: every first attempt deposits ``ratio`` of a
retry, a floor of ``min_per_s`` retries per second accrues with time, and a retry withdraws
one. The balance is capped (ten seconds of floor plus ten requests' worth), so a quiet spell
cannot bank an unbounded burst. Under a fleet-wide failure, retries add at most
``ratio`` × requests + ``min_per_s`` × seconds + the cap to the upstream's load.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable

from gateway.config.resilience import Retries


class RetryBudget:
    def __init__(self, ratio: float, min_per_s: float, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.ratio = ratio
        self.min_per_s = min_per_s
        self.cap = 10.0 * min_per_s + 10.0 * ratio
        self._clock = clock
        self._balance = self.cap
        self._at = clock()
        self.denied = 0

    def _accrue(self) -> None:
        now = self._clock()
        self._balance = min(self.cap, self._balance + (now - self._at) * self.min_per_s)
        self._at = now

    def deposit(self) -> None:
        """A first attempt was made."""
        self._accrue()
        self._balance = min(self.cap, self._balance + self.ratio)

    def withdraw(self) -> bool:
        """May one retry be made now?"""
        self._accrue()
        if self._balance >= 1.0:
            self._balance -= 1.0
            return True
        self.denied += 1
        return False

    @property
    def balance(self) -> float:
        self._accrue()
        return self._balance


def backoff_s(r: Retries, retry: int, rng: random.Random) -> float:
    """The pause before retry number ``retry`` (1, 2, ...): exponential, capped, and jittered
    uniformly over [50%, 150%] so that retries from many requests do not arrive in step."""
    base = min(r.backoff_ms * 2.0 ** (retry - 1), r.max_backoff_ms)
    return base * rng.uniform(0.5, 1.5) / 1000.0


class Retrier:
    """The one retry policy of the request path, for first attempts and for moving a stream
    (``dispatch``, ``attempt.continue_stream``): at most ``max_attempts``
    endpoints, each retry paid from the pool's budget and, after an overload answer or a
    stall, preceded by a jittered backoff."""

    def __init__(self, r: Retries, budget: RetryBudget, rng: random.Random) -> None:
        self.r = r
        self.budget = budget
        self.rng = rng
        self.attempts = 0

    def first(self) -> None:
        """The first attempt is about to be made: it pays into the budget."""
        self.attempts = 1
        self.budget.deposit()

    async def again(self, backoff: bool) -> bool:
        """May another attempt be made (after the pause the failure asks for)?"""
        if self.attempts >= self.r.max_attempts or not self.budget.withdraw():
            return False
        if backoff:
            await asyncio.sleep(backoff_s(self.r, self.attempts, self.rng))
        self.attempts += 1
        return True
