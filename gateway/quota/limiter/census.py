"""How many gateway replicas share the limits, counted through Redis while it answers.

Each replica (each ``serve`` worker process, each EPP) beats every ``interval_s`` into one
sorted set, scored by Redis's own clock (no skew between hosts): its id at now, every member
older than ``ttl_s`` dropped, the set's size answered — one atomic script, one key, one
Cluster slot. A replica that stops leaves the set at once (``leave``); one that dies drops
out after ``ttl_s``.

While Redis is away the count is the last one seen, never a figure from the policy: under
``fail_open`` each replica then admits ``limits / count`` (``ResilientStore``). Replicas
removed during an outage leave the others' shares as they were (the fleet admits less than
the limits); a replica *added* during an outage has never counted anyone, so it admits
nothing locally until Redis answers (it cannot know how many others are admitting) — so the
fleet never admits more than the limits, whatever the autoscaler does meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Callable
from typing import Any, Protocol

log = logging.getLogger("tokengate.limiter")

class Executor(Protocol):  # gateway.redis_clients' clients
    async def execute(self, *args: Any) -> Any: ...

    async def aclose(self) -> None: ...


KEY = "{tokengate:replicas}"
# KEYS[1]: the set; ARGV[1]: this replica; ARGV[2]: ttl in ms. Redis's clock scores members.
_BEAT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZADD', KEYS[1], now, ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - tonumber(ARGV[2]))
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[2]) * 10)
return redis.call('ZCARD', KEYS[1])
"""


class Census:
    def __init__(self, redis: Executor, on_count: Callable[[int], None], *,
                 interval_s: float = 1.0, ttl_s: float = 3.5) -> None:
        self.redis = redis
        self.on_count = on_count
        self.interval_s = interval_s
        self.ttl_s = ttl_s
        self.id = uuid.uuid4().hex
        self.live: int | None = None  # the last count seen; None until Redis first answers

    async def beat(self) -> int:
        n = int(await self.redis.execute("EVAL", _BEAT, "1", KEY, self.id,
                                         str(int(self.ttl_s * 1000))))
        if n != self.live:
            log.info("%d gateway replica(s) share the limits", n)
        self.live = n
        self.on_count(n)
        return n

    async def run(self) -> None:
        while True:
            try:
                await self.beat()
            except Exception as exc:  # Redis away: the last count stands
                log.debug("replica census not updated (%s); %s replica(s) assumed", exc,
                          self.live)
            await asyncio.sleep(self.interval_s)

    async def leave(self) -> None:
        """Out of the count at once (a clean stop)."""
        with contextlib.suppress(Exception):
            await self.redis.execute("ZREM", KEY, self.id)
