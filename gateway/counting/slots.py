"""Who may tokenize in the worker pool: a request with much text is counted off the event
loop (``tokenize.OFFLOAD_CHARS``), at most ``per_tenant`` of one tenant's at a time, so that
one tenant's huge requests cannot fill the pool while others' wait to be counted."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager


class CountingSlots:
    def __init__(self, workers: int) -> None:
        self.per_tenant = max(1, workers // 2)
        self._slots: dict[str, tuple[asyncio.Semaphore, list[int]]] = {}

    @asynccontextmanager
    async def slot(self, tenant: str) -> AsyncIterator[None]:
        """Hold one of ``tenant``'s counting slots (waiting for one when all are held)."""
        entry = self._slots.get(tenant)
        if entry is None:
            entry = self._slots[tenant] = (asyncio.Semaphore(self.per_tenant), [0])
        sem, users = entry
        users[0] += 1
        try:
            async with sem:
                yield
        finally:
            users[0] -= 1
            if not users[0]:  # tenants that come and go leave nothing behind
                del self._slots[tenant]

    @property
    def tenants(self) -> int:
        """Tenants counting or waiting to count now."""
        return len(self._slots)
