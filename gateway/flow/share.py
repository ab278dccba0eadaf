"""Fair-share counters shared by gateway replicas through Redis (active-active).

Each replica orders its own queue by tenant counters that all replicas change: every
``interval_s`` it sends what it did to each since the last exchange, a ``delta.Delta``
(charges and corrections are added; a lift is a ``max``, never an addition, so a tenant that
returns after this replica forgot it is lifted to the floor, not by it), and reads back the
totals, in one round trip (a Lua script over one hash per model, which keeps the hash's keys
in one Redis Cluster slot), then orders by the totals with what it changed since. Only
tenants are shared (a tenant's sub-flows, ``x-fairness-id``, are ordered per replica), so
the hash has one field per tenant and an exchange costs the same however many ids clients
send. Within one exchange interval a replica does not see what the others served, so between
two tenants backlogged on every replica the weighted service differs by at most VTC's own
bound plus what the other replicas serve in one interval: ``2·max(w_in·L_in, w_out·M) +
(R − 1)·S·interval`` for ``R`` replicas each serving ``S`` weighted tokens per second.

If Redis cannot be reached, each replica goes on with its own counters (fairness per replica,
not across them), keeps what it could not send, and sends it when Redis answers again; no
request waits on Redis.
"""

from __future__ import annotations

import asyncio
import logging
import math

from gateway.flow.control import FlowGates
from gateway.flow.delta import Delta
from gateway.redis_clients import Executor

log = logging.getLogger("tokengate.flow")
KEY = "{tokengate:flow}:vtc:"
TTL_S = 7 * 86400  # counters of a model nobody sends to any more go after a week

# KEYS[1]: the model's hash; ARGV[1]: its ttl (s); then per tenant 4 values: field, before,
# lift ('' for none), after. Each counter x becomes max(x + before, lift) + after; answers
# every field's value after.
_APPLY = """
for i = 2, #ARGV, 4 do
  local x = tonumber(redis.call('HGET', KEYS[1], ARGV[i]) or '0') + tonumber(ARGV[i + 1])
  if ARGV[i + 2] ~= '' then x = math.max(x, tonumber(ARGV[i + 2])) end
  redis.call('HSET', KEYS[1], ARGV[i], string.format('%.17g', x + tonumber(ARGV[i + 3])))
end
redis.call('EXPIRE', KEYS[1], ARGV[1])
return redis.call('HGETALL', KEYS[1])
"""


async def apply_deltas(redis: Executor, key: str, deltas: dict[str, Delta]
                       ) -> dict[str, float]:
    """Apply each tenant's ``Delta`` to the shared counters; answers the totals."""
    args: list[str] = []
    for f, d in deltas.items():
        args += [f, repr(d.before), "" if d.lift == -math.inf else repr(d.lift), repr(d.after)]
    raw = await redis.execute("EVAL", _APPLY, "1", key, str(TTL_S), *args)
    return {(raw[i].decode() if isinstance(raw[i], bytes) else raw[i]): float(raw[i + 1])
            for i in range(0, len(raw) - 1, 2)}


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
                shared = await apply_deltas(self.redis, KEY + model, deltas)
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

