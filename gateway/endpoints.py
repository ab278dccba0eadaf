"""A model's endpoint pool: live in-flight counters, a least-outstanding-tokens pick, and
circuit breaking. The routing issue replaces ``pick`` with its scheduler behind the same call.

Health: an endpoint that failed ``trip_after`` times in a row (connect errors, 5xx before the
first byte, broken streams) is skipped for ``cooldown_s``; one success resets it. When every
endpoint is cooling down the pool still offers them (failing open beats refusing all traffic).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from gateway.config.policy import Endpoint, Model


@dataclass(slots=True, eq=False)
class EndpointState:
    url: str
    api_key: str | None
    in_flight: int = 0
    tokens_outstanding: int = 0
    consecutive_failures: int = 0
    down_until: float = 0.0
    served: int = 0
    failed: int = 0

    def healthy(self, now: float) -> bool:
        return now >= self.down_until


class EndpointPool:
    def __init__(self, model: Model, resolve_key: Callable[[Endpoint], str | None], *,
                 seed: int = 0, trip_after: int = 3, cooldown_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.model = model
        self.endpoints = [EndpointState(e.url, resolve_key(e)) for e in model.endpoints]
        self._rng = random.Random(seed)
        self.trip_after = trip_after
        self.cooldown_s = cooldown_s
        self._clock = clock

    def candidates(self, exclude: Sequence[EndpointState] = ()) -> list[EndpointState]:
        now = self._clock()
        left = [e for e in self.endpoints if e not in exclude]
        healthy = [e for e in left if e.healthy(now)]
        return healthy or left

    def pick(self, exclude: Sequence[EndpointState] = ()) -> EndpointState | None:
        """Least outstanding tokens, then fewest in flight; ties broken at random (seeded)."""
        cands = self.candidates(exclude)
        if not cands:
            return None
        best = min((e.tokens_outstanding, e.in_flight) for e in cands)
        tied = [e for e in cands if (e.tokens_outstanding, e.in_flight) == best]
        return tied[0] if len(tied) == 1 else self._rng.choice(tied)

    def acquire(self, e: EndpointState, tokens: int) -> None:
        e.in_flight += 1
        e.tokens_outstanding += tokens

    def release(self, e: EndpointState, tokens: int) -> None:
        e.in_flight -= 1
        e.tokens_outstanding -= tokens

    def succeeded(self, e: EndpointState) -> None:
        e.consecutive_failures = 0
        e.down_until = 0.0
        e.served += 1

    def failed(self, e: EndpointState) -> None:
        e.failed += 1
        e.consecutive_failures += 1
        if e.consecutive_failures >= self.trip_after:
            e.down_until = self._clock() + self.cooldown_s
