"""The routing state's clock: ``time.monotonic`` in a gateway, virtual time in the simulator.

Live counters (``gateway.routing.endpoints``) and routing decisions (``gateway.routing.router``)
read the time through ``now()`` so that the fleet simulator (``simulator``) can run the very
same code on a discrete-event clock. ``use(fn)`` installs another clock and returns the one
it replaced; only the simulator calls it, once per run, and puts the old one back.
"""

from __future__ import annotations

import time
from collections.abc import Callable

_clock: Callable[[], float] = time.monotonic


def now() -> float:
    return _clock()


def use(clock: Callable[[], float]) -> Callable[[], float]:
    global _clock
    old, _clock = _clock, clock
    return old
