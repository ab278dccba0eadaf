"""Fair-share counters shared by gateway replicas through Redis (active-active).

Each replica orders its own queue, by counters that all replicas add to: every ``interval_s``
it sends what its counters changed by since the last exchange (charges, corrections, lifts)
and reads back the totals, in one round trip (a Lua script over one hash per model, which
keeps the hash's keys in one Redis Cluster slot), and orders by the totals plus what it changed
since. Within one exchange interval a replica does not see what the others served, so between
two flows backlogged on every replica the weighted service differs by at most VTC's own bound
plus what the other replicas serve in one interval: ``2·U + (R − 1)·S·interval`` for ``R``
replicas each serving ``S`` weighted tokens per second.

If Redis cannot be reached, each replica goes on with its own counters (fairness per replica,
not across them), keeps what it could not send, and sends it when Redis answers again; no
request waits on Redis.
"""

from __future__ import annotations

import asyncio
import logging

from gateway.flow.control import FlowGates
from gateway.redis_clients import Executor, add_to_hash

log = logging.getLogger("tokengate.flow")
KEY = "{tokengate:flow}:vtc:"
TTL_S = 7 * 86400  # counters of a model nobody sends to any more go after a week

class CounterShare:
    def __init__(self, redis: Executor, gates: FlowGates, interval_s: float = 0.1) -> None:
        self.redis = redis
        self.gates = gates
        self.interval_s = interval_s
        self.exchanges = 0
        self.failures = 0
        self.degraded = False

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self.exchange()

    async def exchange(self) -> None:
        """One round: every fair gate sends its changes and adopts the totals."""
        for model, mg in list(self.gates.gates.items()):
            q = mg.gate.queue
            if q.mode != "fair":
                continue
            deltas = q.take_deltas()
            try:
                shared = await add_to_hash(self.redis, KEY + model, TTL_S, deltas,
                                           totals=True)
            except Exception as exc:  # any Redis failure: go on alone
                q.give_back(deltas)
                self.failures += 1
                if not self.degraded:
                    log.warning("fair-share counters are not shared (Redis: %s): each "
                                "replica orders by its own until Redis answers", exc)
                self.degraded = True
                return
            q.adopt(shared)
        self.exchanges += 1
        if self.degraded:
            log.warning("fair-share counters are shared again")
        self.degraded = False

