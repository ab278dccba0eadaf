"""Warnings an upstream can cause on every request, at most one line per cause and endpoint
per period: an engine that misreports usage, or answers every request with an error, would
otherwise write one line per request (and push the rest of the log out of the writer's
queue). The first occurrence is written at once; while it keeps happening, one line per
period says how many were held back. Counting each occurrence is the metrics' job."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable

PERIOD_S = 60.0
MAX_KEYS = 4096  # causes remembered (endpoints come from the policy; this bounds the rest)


class Throttle:
    def __init__(self, period_s: float = PERIOD_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.period_s = period_s
        self.clock = clock
        self._last: dict[Hashable, tuple[float, int]] = {}  # key -> (written at, held back)

    def warning(self, log: logging.Logger, key: Hashable, msg: str, *args: object) -> None:
        """``log.warning(msg, *args)`` unless ``key`` was written less than a period ago
        (then it is counted, and said with the next line written for ``key``)."""
        now = self.clock()
        at, held = self._last.get(key, (-float("inf"), 0))
        if now - at < self.period_s:
            self._last[key] = (at, held + 1)
            return
        if len(self._last) >= MAX_KEYS and key not in self._last:
            self._last.clear()
        self._last[key] = (now, 0)
        if held:
            msg += " (and %d more like it in the last %.0f s)"
            args = (*args, held, now - at)
        log.warning(msg, *args)


UPSTREAM = Throttle()  # what upstreams cause, keyed by cause and endpoint
