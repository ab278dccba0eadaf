"""The RateStore contract in Redis: Lua scripts, server time, one round trip per decision.

Each scope is one hash ``tg:{scope}`` (fields: one TAT per limit kind); the braces are a hash
tag, so all of a scope's keys sit in one Redis Cluster slot. The scripts (package data, loaded
once, run with EVALSHA) do exactly what ``bucket.py`` does, at Redis server time so replicas
agree on ``now``.

* Single Redis: one script call reserves on every scope of a request, all or nothing, over a
  lean pipelined RESP client (``resp.py``).
* Redis Cluster: scopes live in different slots, so each scope is reserved by its own call, in
  order; if one refuses, what the earlier ones reserved is refunded. No request is ever
  over-admitted; a concurrent request may be refused for a moment by a reservation that is
  then rolled back.

Adjustments are made idempotent by a marker: one hash per reservation
(``tg:{scope}:s:<reservation>``, a field per step: ``p1``, ``p2``, ..., ``final``) set in the same
script, so a retried settlement step applies once. The hash expires with the reservation's
life (``Reservation.life_s``: the route's hold + queue + total timeouts plus a minute), the
longest its settlement can take, so Redis holds at most request rate × that many of them.

Calls whose outcome is unknown (the reply timed out or the connection dropped: the command
may have run, or may still run when a stalled Redis resumes) are made good, in the
background, until they succeed or the reservation's life ends (``Owed``):

* a reservation is *voided* by id (``void.lua``): given back if it ran, and refused should it
  run later -- exactly once either way; the caller has already answered 503 or served from
  its local limiter;
* a settlement step is sent again: its marker makes it apply once whether or not the first
  send ran. ``adjust`` counts it as done (the settlement records it), since it will be.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from importlib.resources import files
from typing import Any

from redis import exceptions as rexc
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster

from gateway.quota.limiter import bucket
from gateway.quota.limiter.redis_client import FastRedis, NoScript, RespError
from gateway.quota.limiter.store import (
    DEFAULT_LIFE_S,
    BucketState,
    Charge,
    Decision,
    Reservation,
    StoreStats,
    StoreUnavailable,
)

# NOTE: RedisClusterException is not a RedisError: redis-py raises it when re-discovering a
# cluster finds no reachable node (a master just killed, the rest slow to answer).
_ERRORS = (rexc.ConnectionError, rexc.TimeoutError, rexc.ClusterDownError,
           rexc.ClusterError, rexc.RedisClusterException, OSError, TimeoutError, RespError)


log = logging.getLogger("tokengate.limiter")


@dataclass(slots=True)
class Owed:
    """A call whose outcome was lost, to be made good (it is idempotent) until ``until``."""

    call: Callable[[], Awaitable[object]]
    until: float  # monotonic
    what: str


def _script(name: str) -> str:
    return (files("gateway.quota.limiter") / "lua" / name).read_text()


MAX_TTL_MS = 400 * 86400 * 1000


def _key(scope: str) -> str:
    return f"tg:{{{scope}}}"


def _ttl_ms(c: Charge) -> int:
    if c.limit.expires_at is not None:  # a calendar window: kept a day past its end, for
        # the settlements of requests admitted in it
        return int((max(c.limit.expires_at - time.time(), 0.0) + 86400.0) * 1000)
    # (a bucket that never refills lives as long as Redis allows, a little over a year)
    return min(int((c.limit.tolerance + c.limit.period_s) * 1000) + 1000, MAX_TTL_MS)


class RedisStore:
    def __init__(self, client: FastRedis | Redis | RedisCluster, *, cluster: bool = False
                 ) -> None:
        self._r = client
        self._cluster = cluster
        self._reserve_src = _script("reserve.lua")
        self._adjust_src = _script("adjust.lua")
        self._void_src = _script("void.lua")
        self._peek_src = _script("peek.lua")
        self._lift_src = _script("lift.lua")
        self._sha: dict[str, str] = {}
        self.owed: dict[tuple[str, str], Owed] = {}  # (reservation, step or scope) -> call
        self._paying: asyncio.Task[None] | None = None
        self.retry_s = (0.05, 1.0)  # the first and the longest pause between attempts
        self._init_lock: asyncio.Lock | None = None
        self._initialized = not cluster
        self.stats = StoreStats()

    async def _ensure_initialized(self) -> None:
        """Discover the cluster once: concurrent first calls would each open connections."""
        if self._initialized:
            return
        self._init_lock = self._init_lock or asyncio.Lock()
        async with self._init_lock:
            if not self._initialized and isinstance(self._r, RedisCluster):
                await self._r.initialize()
                self._initialized = True

    @classmethod
    def from_url(cls, url: str, **kw: Any) -> RedisStore:
        """``redis://host:port/db`` or ``redis+cluster://host:port`` (any one node)."""
        opts = {"socket_timeout": 1.0, "socket_connect_timeout": 1.0, **kw}
        if url.startswith("redis+cluster://"):
            # The async cluster client fails rather than waits past max_connections per node.
            opts.setdefault("max_connections", 4096)
            return cls(RedisCluster.from_url("redis://" + url[len("redis+cluster://"):], **opts),
                       cluster=True)
        return cls(FastRedis(url, timeout_s=float(opts["socket_timeout"])))

    async def _eval(self, src: str, keys: Sequence[str], args: Sequence[Any],
                    defer: bool = False) -> Any:
        self.stats.round_trips += 1
        sha = self._sha.get(src)
        try:
            await self._ensure_initialized()
            if sha is None:
                sha = self._sha[src] = await self._r.script_load(src)
            try:
                if defer and isinstance(self._r, FastRedis):
                    return await self._r.evalsha(sha, len(keys), *keys, *args, defer=True)
                return await self._r.evalsha(sha, len(keys), *keys, *args)
            except (rexc.NoScriptError, NoScript):  # a restarted node lost its scripts
                return await self._r.eval(src, len(keys), *keys, *args)
        except _ERRORS as exc:
            raise StoreUnavailable(str(exc)) from exc

    async def reserve(self, charges: Sequence[Charge], reservation_id: str, *,
                      life_s: float = DEFAULT_LIFE_S, optional: Sequence[Charge] = ()
                      ) -> Decision:
        if not self._cluster:
            try:
                return await self._reserve_group(charges, reservation_id, life_s, optional)
            except StoreUnavailable:
                self._void_later(Reservation(reservation_id, (*charges, *optional), life_s,
                                             len(optional)))
                raise
        groups: dict[str, list[Charge]] = defaultdict(list)
        for c in charges:
            groups[c.scope].append(c)
        done: list[Charge] = []
        states: list[BucketState] = []
        for group in groups.values():
            try:
                d = await self._reserve_group(group, reservation_id, life_s)
            except StoreUnavailable:
                # Each group is its own reservation (marker in its own slot): void what ran,
                # and the one whose answer was lost.
                for g in groups.values():
                    self._void_later(Reservation(reservation_id, tuple(g), life_s))
                    if g is group:
                        break
                raise
            states.extend(d.states)
            if not d.allowed:
                if done:
                    partial = Reservation(reservation_id, tuple(done), life_s)
                    await self.adjust(partial, {c.key: -c.cost for c in done}, "rollback")
                return Decision(False, None, tuple(states), d.denied)
            done.extend(group)
        took = await self._optional_group(optional, reservation_id, life_s) if optional \
            else False
        held = (*charges, *optional) if took else tuple(charges)
        return Decision(True, Reservation(reservation_id, held, life_s), tuple(states),
                        optional=took)

    async def _optional_group(self, optional: Sequence[Charge], reservation_id: str,
                              life_s: float) -> bool:
        """A cluster's optional charges, once the others are reserved: one more call (their
        scope's slot; one scope, the tier's). Not taken when it fails: they never refuse."""
        if len({c.scope for c in optional}) != 1:
            raise ValueError("a cluster takes optional charges on one scope")
        try:
            return (await self._reserve_group((), reservation_id, life_s, optional)).optional
        except StoreUnavailable:
            self._void_later(Reservation(reservation_id, tuple(optional), life_s,
                                         len(optional)))
            return False

    def _marker(self, reservation_id: str, scope: str) -> str:
        return f"{_key(scope)}:s:{reservation_id}"

    async def void(self, reservation: Reservation) -> int:
        """Give a reservation back if it ran, and make sure it never runs after this (its
        charges all in one slot: one group of a cluster's). 1: given back, 2: it had not run,
        0: already voided."""
        cs = reservation.charges
        keys = [self._marker(reservation.id, cs[0].scope), *(_key(c.scope) for c in cs)]
        args: list[Any] = [len(cs), max(1, math.ceil(reservation.life_s * 1000))]
        for c in cs:
            args += [c.limit.kind, repr(c.limit.interval), repr(c.cost), _ttl_ms(c)]
        args.append(reservation.optional)
        return int(await self._eval(self._void_src, keys, args))

    def _void_later(self, reservation: Reservation) -> None:
        if reservation.charges:
            self._owe((reservation.id, "void:" + reservation.charges[0].scope),
                      lambda: self.void(reservation), reservation.life_s,
                      f"void {reservation.id}")

    def _owe(self, key: tuple[str, str], call: Callable[[], Awaitable[object]],
             life_s: float, what: str) -> None:
        self.owed[key] = Owed(call, time.monotonic() + life_s, what)
        self.stats.owed = len(self.owed)
        if self._paying is None or self._paying.done():
            self._paying = asyncio.ensure_future(self._pay())

    async def _pay(self) -> None:
        """Make good what is owed, backing off while the store is away."""
        pause = self.retry_s[0]
        while self.owed:
            await asyncio.sleep(pause)
            paid_all = await self._pay_once()
            self.stats.owed = len(self.owed)
            pause = self.retry_s[0] if paid_all else min(pause * 2, self.retry_s[1])

    async def _pay_once(self) -> bool:
        """One pass, oldest first; False when the store was still away (the pass stops at
        the first call it refused: the rest would wait out the same timeout)."""
        for key, o in list(self.owed.items()):
            try:
                await o.call()
            except StoreUnavailable:
                if time.monotonic() < o.until:
                    return False
                self.stats.abandoned += 1
                log.error("gave up on %s: the rate store was away past its life", o.what)
            else:
                self.stats.compensated += 1
            del self.owed[key]
        return True

    async def _reserve_group(self, charges: Sequence[Charge], reservation_id: str,
                             life_s: float, optional: Sequence[Charge] = ()) -> Decision:
        every = (*charges, *optional)
        args: list[Any] = [len(every)]
        for c in every:
            lim = c.limit
            args += [lim.kind, repr(lim.interval), repr(lim.tolerance), repr(lim.burst),
                     repr(c.cost), _ttl_ms(c)]
        args += [max(1, math.ceil(life_s * 1000)), len(optional)]
        keys = [*(_key(c.scope) for c in every), self._marker(reservation_id, every[0].scope)]
        raw = await self._eval(self._reserve_src, keys, args)
        allowed, index, now = int(raw[0]), int(raw[1]), float(raw[2])
        retry, took = float(raw[3]), int(raw[4]) == 1
        tats = [float(x) for x in raw[5:5 + len(charges)]]
        states = tuple(BucketState(c.scope, c.limit, bucket.remaining(t, now, c.limit),
                                   bucket.reset_after(t, now), c.cost)
                       for c, t in zip(charges, tats, strict=True))
        if allowed:
            held = every if took else tuple(charges)
            return Decision(True, Reservation(reservation_id, held, life_s), states,
                            optional=took)
        if not charges:  # optional ones alone: a voided reservation (never awaited)
            return Decision(False, None)
        c = charges[index - 1]
        t = tats[index - 1]
        denied = BucketState(c.scope, c.limit, bucket.remaining(t, now, c.limit),
                             bucket.reset_after(t, now), c.cost,
                             math.inf if retry < 0 else retry)
        return Decision(False, None, states, denied)

    async def adjust(self, reservation: Reservation, deltas: Mapping[tuple[str, str], float],
                     step: str) -> bool:
        limits = {c.key: c for c in reservation.charges}
        groups: dict[str, list[tuple[Charge, float]]] = defaultdict(list)
        for key, delta in deltas.items():
            c = limits[key]
            groups[c.scope if self._cluster else ""].append((c, delta))
        if not groups:
            groups[""] = []
        # A pure refund may wait a moment for company on the connection (FastRedis's
        # ``defer``): it only returns quota, so holding it back never admits too much.
        refund = all(d <= 0 for d in deltas.values())
        applied = False
        for scope, items in groups.items():
            marker_scope = scope or (reservation.charges[0].scope if reservation.charges
                                     else "none")
            keys = [self._marker(reservation.id, marker_scope),
                    *(_key(c.scope) for c, _ in items)]
            args: list[Any] = [len(items), step, max(1, math.ceil(reservation.life_s * 1000))]
            for c, d in items:
                args += [c.limit.kind, repr(c.limit.interval), repr(d), _ttl_ms(c)]
            try:
                applied = bool(int(await self._eval(self._adjust_src, keys, args,
                                                    refund))) or applied
            except StoreUnavailable:
                # Lost or not, the step is marked: sending it again applies it once.
                async def again(keys: list[str] = keys, args: list[Any] = args) -> object:
                    return await self._eval(self._adjust_src, keys, args)

                self._owe((reservation.id, f"{step}:{marker_scope}"), again,
                          reservation.life_s, f"step {step} of {reservation.id}")
                applied = True
        return applied

    async def peek(self, charges: Sequence[Charge]) -> list[BucketState]:
        """One script call per scope (a scope's buckets share a hash, and a Cluster slot)."""
        by_scope: dict[str, list[Charge]] = defaultdict(list)
        for c in charges:
            by_scope[c.scope].append(c)
        out: dict[tuple[str, str], BucketState] = {}
        for scope, cs in by_scope.items():
            raw = await self._eval(self._peek_src, [_key(scope)], [c.limit.kind for c in cs])
            now = int(raw[0]) + int(raw[1]) / 1e6
            for c, v in zip(cs, raw[2:], strict=True):
                tat = float(v) if v not in (b"", "", None) else 0.0
                out[c.key] = BucketState(c.scope, c.limit, bucket.remaining(tat, now, c.limit),
                                         bucket.reset_after(tat, now))
        return [out[c.key] for c in charges]

    async def lift(self, charges: Sequence[Charge]) -> int:
        """One script call per scope, at Redis server time."""
        by_scope: dict[str, list[Charge]] = defaultdict(list)
        for c in charges:
            by_scope[c.scope].append(c)
        raised = 0
        for scope, cs in by_scope.items():
            args = [a for c in cs for a in (c.limit.kind, repr(c.limit.interval), repr(c.cost),
                                             str(_ttl_ms(c)))]
            raised += int(await self._eval(self._lift_src, [_key(scope)], args))
        return raised

    async def close(self) -> None:
        if self._paying is not None and not self._paying.done():
            self.retry_s = (0.0, 0.0)  # one more pass at once, then give up what is left
            try:
                await asyncio.wait_for(asyncio.shield(self._paying), 2.0)
            except TimeoutError:
                self._paying.cancel()
            for o in self.owed.values():
                log.error("closing with %s still owed to the rate store", o.what)
        await self._r.aclose()
