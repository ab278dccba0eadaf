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

A replica also says, in the same round trip, which tenants wait in its queue, and learns
which wait at the others: a tenant's requests may reach one replica only (a client's
keep-alive connection stays with one pod), so no replica's own queue holds both tenants that
compete. A replica lets its least-served tenant through only while no tenant waiting at
another replica has been served less by more than what a replica serves in about one
interval (``FairQueue.behind_elsewhere``); the other replica, whose tenant is behind, takes
the room. Two replicas never both hold back for long: each sees the other's counter at most
one interval late, and the margin covers that. The list also names the tenants with
requests running at the replica, so that ``isolation_step_ms`` holds a tenant served more than
another to a smaller batch even at a replica where the other has nothing running (its
requests run through another replica, on the same engines), and how many requests it sent to
each endpoint are still waiting for their first token: a replica counts the others' beside
its own when it decides whether an endpoint's queue has room (``saturation.room``), so
replicas together keep an engine's first-come queue as short as one gateway would, instead
of each putting ``queue_depth`` requests into it. A replica's list lives one second unless
renewed, so one that dies holds nobody back.

If Redis cannot be reached, each replica goes on with its own counters (fairness per replica,
not across them), keeps what it could not send, and sends it when Redis answers again; no
request waits on Redis.
"""

from __future__ import annotations

import asyncio
import logging
import math
import uuid
from collections.abc import Iterable, Mapping
from typing import NamedTuple

from gateway.flow.control import FlowGates
from gateway.flow.delta import Delta
from gateway.redis_clients import Executor
from gateway.routing.endpoints import EndpointState

log = logging.getLogger("tokengate.flow")
KEY = "{tokengate:flow}:vtc:"
WAITING = "{tokengate:flow}:waiting:"  # same slot as KEY
INTERVAL_S = 0.1  # between two exchanges of a replica
TTL_S = 7 * 86400  # counters of a model nobody sends to any more go after a week

WAITING_LIFE_MS = 1000  # a replica's list of waiting tenants, unless renewed (it died)

# KEYS[1]: the model's counters (a hash), KEYS[2]: which tenants wait at which replica (a
# hash: replica -> cjson [expiry ms, entries...]); ARGV[1]: the ttl (s), ARGV[2]: this
# replica, ARGV[3]: how long its list lives (ms), ARGV[4]: how many entries follow (a tenant
# waiting here as "rank:tenant", one with requests running here as "r:tenant", an endpoint
# with requests sent from here awaiting their first token as "q:count:url"), then those,
# then per tenant 4 values: field, before, lift ('' for none), after. Each counter x becomes
# max(x + before, lift) + after. Answers every counter's value after, and
# the other replicas' live lists (expired ones are deleted).
_APPLY = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local nw = tonumber(ARGV[4])
if nw > 0 then
  local mine = {now + tonumber(ARGV[3])}
  for i = 5, 4 + nw do mine[#mine + 1] = ARGV[i] end
  redis.call('HSET', KEYS[2], ARGV[2], cjson.encode(mine))
  redis.call('EXPIRE', KEYS[2], 60)
else
  redis.call('HDEL', KEYS[2], ARGV[2])
end
for i = 5 + nw, #ARGV, 4 do
  local x = tonumber(redis.call('HGET', KEYS[1], ARGV[i]) or '0') + tonumber(ARGV[i + 1])
  if ARGV[i + 2] ~= '' then x = math.max(x, tonumber(ARGV[i + 2])) end
  redis.call('HSET', KEYS[1], ARGV[i], string.format('%.17g', x + tonumber(ARGV[i + 3])))
end
redis.call('EXPIRE', KEYS[1], ARGV[1])
local others = {}
local lists = redis.call('HGETALL', KEYS[2])
for i = 1, #lists, 2 do
  if lists[i] ~= ARGV[2] then
    local v = cjson.decode(lists[i + 1])
    if v[1] < now then
      redis.call('HDEL', KEYS[2], lists[i])
    else
      for j = 2, #v do others[#others + 1] = v[j] end
    end
  end
end
return {redis.call('HGETALL', KEYS[1]), others}
"""


def _text(v: bytes | str) -> str:
    return v.decode() if isinstance(v, bytes) else v


class Exchanged(NamedTuple):
    counters: dict[str, float]  # every tenant's shared counter
    elsewhere: dict[str, int]  # tenants waiting at other replicas: their highest band's rank
    running_elsewhere: frozenset[str]  # tenants with requests running at other replicas
    pending_elsewhere: dict[str, int]  # endpoint URL -> requests others sent awaiting a token


async def apply_deltas(redis: Executor, key: str, deltas: dict[str, Delta],
                       replica: str = "", waiting: Mapping[str, int] | None = None,
                       running: Iterable[str] = (), pending: Mapping[str, int] | None = None
                       ) -> Exchanged:
    """Apply each tenant's ``Delta`` to the shared counters and say which tenants wait at
    this ``replica`` (with the rank of their highest band), which have requests running here
    and how many requests sent from here await their first token at each endpoint
    (``pending``, by URL); answers the totals and the same of the other replicas."""
    entries = [f"{rank}:{t}" for t, rank in (waiting or {}).items()]
    entries += [f"r:{t}" for t in running]
    entries += [f"q:{n}:{url}" for url, n in (pending or {}).items() if n > 0]
    args: list[str] = [str(TTL_S), replica, str(WAITING_LIFE_MS), str(len(entries)),
                       *entries]
    for f, d in deltas.items():
        args += [f, repr(d.before), "" if d.lift == -math.inf else repr(d.lift), repr(d.after)]
    counters, others = await redis.execute("EVAL", _APPLY, "2", key, WAITING + key[len(KEY):],
                                           *args)
    elsewhere: dict[str, int] = {}
    running_elsewhere: set[str] = set()
    pending_elsewhere: dict[str, int] = {}
    for e in map(_text, others):
        rank, _, tenant = e.partition(":")
        if rank == "r":
            running_elsewhere.add(tenant)
        elif rank == "q":
            n, _, url = tenant.partition(":")
            if n.isdigit():
                pending_elsewhere[url] = pending_elsewhere.get(url, 0) + int(n)
        elif rank.isdigit():
            elsewhere[tenant] = min(int(rank), elsewhere.get(tenant, 9))
        # anything else is an entry of a later version (a rolling upgrade): not this one's
    return Exchanged(
        {_text(counters[i]): float(counters[i + 1]) for i in range(0, len(counters) - 1, 2)},
        elsewhere, frozenset(running_elsewhere), pending_elsewhere)


class CounterShare:
    def __init__(self, redis: Executor, gates: FlowGates, interval_s: float = INTERVAL_S) -> None:
        self.redis = redis
        self.gates = gates
        self.interval_s = interval_s
        self.exchanges = 0
        self.failures = 0
        self.degraded = False
        self.replica = uuid.uuid4().hex
        self._served: dict[str, float] = {}  # per model: service per interval (EWMA)

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
            endpoints = mg.gate.endpoints()
            try:
                shared, elsewhere, running, pending = await apply_deltas(
                    self.redis, KEY + model, deltas, self.replica, q.bands_waiting(),
                    mg.gate.running, {e.url: len(e.live.pending) for e in endpoints})
            except Exception as exc:  # any Redis failure: go on alone
                q.give_back(deltas)
                q.elsewhere = {}
                mg.gate.running_elsewhere = frozenset()
                _pending_elsewhere(endpoints, {})
                self.failures += 1
                if not self.degraded:
                    log.warning("fair-share counters are not shared (Redis: %s): each "
                                "replica orders by its own until Redis answers", exc)
                self.degraded = True
                return
            q.elsewhere = elsewhere  # before adopt: who waits elsewhere is not forgotten
            mg.gate.running_elsewhere = running
            q.adopt(shared)
            if _pending_elsewhere(endpoints, pending):
                mg.pump()  # another replica's requests started: room it did not see
            # how far ahead of a tenant waiting elsewhere one waiting here may be served: what
            # a replica serves in about one interval, so that two replicas each seeing the
            # other's counter one interval late never both hold back
            served = sum(abs(d.before + d.after) for d in deltas.values())
            ewma = self._served.get(model, served)
            self._served[model] = ewma = 0.8 * ewma + 0.2 * served
            q.slack = 2.0 * max(ewma, served)
        self.exchanges += 1
        if self.degraded:
            log.warning("fair-share counters are shared again")
        self.degraded = False


def _pending_elsewhere(endpoints: Iterable[EndpointState], counts: Mapping[str, int]) -> bool:
    """Set each endpoint's count of requests other replicas sent it that await their first
    token; whether any fell."""
    fell = False
    for e in endpoints:
        n = counts.get(e.url, 0)
        fell |= n < e.live.pending_elsewhere
        e.live.pending_elsewhere = n
    return fell
