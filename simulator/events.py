"""A discrete-event clock: callbacks ordered by (time, insertion), run until none is left.

Ties run in the order they were scheduled, so a run is a pure function of its inputs.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from typing import Any


class EventLoop:
    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[..., Any], tuple[Any, ...]]] = []
        self._seq = itertools.count()
        self.processed = 0

    def time(self) -> float:
        return self.now

    def at(self, t: float, fn: Callable[..., Any], *args: Any) -> None:
        heapq.heappush(self._heap, (max(t, self.now), next(self._seq), fn, args))

    def after(self, dt: float, fn: Callable[..., Any], *args: Any) -> None:
        self.at(self.now + dt, fn, *args)

    def run(self, until: float | None = None, stop: Callable[[], bool] | None = None) -> None:
        """Run events in order until there are none (or the next is past ``until``, or
        ``stop()`` says so after an event)."""
        heap = self._heap
        while heap:
            t, _, fn, args = heap[0]
            if until is not None and t > until:
                break
            heapq.heappop(heap)
            self.now = t
            fn(*args)
            self.processed += 1
            if stop is not None and stop():
                break
