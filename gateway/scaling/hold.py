"""Holding requests while a pool has nothing ready to serve them (scale from zero, or a
pool whose instances are all starting): at most ``max_held`` wait, each up to its route's
``hold_timeout_ms``, and the count is what wakes the pool (``PoolScaler`` reads ``held``)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable


class HoldGate:
    def __init__(self, max_held: int, on_change: Callable[[int], None]) -> None:
        self.max_held = max_held
        self.ready = asyncio.Event()
        self.held = 0
        self._on_change = on_change

    def open(self, ready: bool) -> None:
        """Whether something can serve a request now."""
        if ready:
            self.ready.set()
        else:
            self.ready.clear()

    async def wait(self, timeout_s: float) -> bool:
        """Wait for the pool to be ready; False if the queue is full or the wait times out."""
        if self.ready.is_set():
            return True
        if self.held >= self.max_held:
            return False
        self.held += 1
        self._on_change(self.held)
        try:
            await asyncio.wait_for(self.ready.wait(), timeout_s)
            return True
        except TimeoutError:
            return False
        finally:
            self.held -= 1
            self._on_change(self.held)
