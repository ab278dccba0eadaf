"""Calendar budgets rebuilt from the spend ledger in PostgreSQL, so a Redis restart (or a
gateway restart on the in-process store) does not forget what was spent this day or month.

At start, and whenever the shared store has lost its data (a marker key each replica checks
every ``check_s``, one ``EXISTS``, is gone: Redis restarted without persistence, or was
flushed), a replica sums the ledger's dollars since the start of every calendar window the
policy sets, by tenant, tenant × model, model and route, *lifts* each budget bucket to at least
that (``RateStore.lift``) and sets the marker again: a bucket already above it (reservations
in flight, records not written yet) is left alone, so a rebuild is idempotent (replicas that
notice together do no harm) and never counts a dollar twice. The ledger holds what requests
cost in their tier, as the budgets settle it. Records that have not reached the database yet
(its batches, a spool) are missing from the sum until they do: right after a Redis restart a
budget may read lower than it is by those, never higher.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import defaultdict
from collections.abc import Callable
from datetime import UTC, datetime

import asyncpg

from gateway.config.policy import Policy
from gateway.quota import calendar
from gateway.quota.ledger import every_bucket
from gateway.quota.limiter.store import Charge, RateStore, StoreUnavailable
from gateway.redis_clients import Executor

log = logging.getLogger("tokengate.spend")
CALENDAR = ("budget_daily", "budget_monthly")
MARKER = "{tokengate:spend}:budgets-rebuilt"  # gone with the data of a restarted Redis
_SUMS = ("SELECT tenant, model, route, sum(dollars) AS dollars FROM tokengate_spend "
         "WHERE at >= $1 GROUP BY tenant, model, route")


class BudgetRebuild:
    def __init__(self, url: str, policy: Callable[[], Policy], store: RateStore,
                 redis: Executor | None = None, *, check_s: float = 1.0,
                 timeout_s: float = 10.0) -> None:
        self.url = url
        self.policy = policy
        self.store = store
        self.redis = redis
        self.check_s = check_s
        self.timeout_s = timeout_s
        self.rebuilds = self.raised = self.failures = 0

    async def run(self) -> None:
        done = False  # this replica's first rebuild (at start) has succeeded
        while True:
            try:
                if not done or (self.redis is not None and not int(
                        await self.redis.execute("EXISTS", MARKER))):
                    await self.rebuild()
                    done = True
                    if self.redis is not None:
                        await self.redis.execute("SET", MARKER, "1")
            except Exception:  # PostgreSQL or Redis away: at the next check
                pass
            await asyncio.sleep(self.check_s)

    async def rebuild(self, now: float | None = None) -> int:
        """One pass; returns how many buckets were raised."""
        policy = self.policy()
        now = now if now is not None else datetime.now(UTC).timestamp()
        buckets = [c for c in every_bucket(policy) if c.limit.kind in CALENDAR]
        if not buckets:
            return 0
        tz = policy.settings.time_zone
        try:
            spent = {kind: await self._sums(calendar.start(kind, now, tz))
                     for kind in {c.limit.kind for c in buckets}}
        except (OSError, TimeoutError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
            self.failures += 1
            log.warning("budgets not rebuilt from the spend ledger (%s)",
                        exc or type(exc).__name__)
            raise
        lifts = []
        for c in buckets:
            used = spent[c.limit.kind].get(c.scope.rpartition("@")[0], 0.0)
            if used > 0:
                lifts.append(Charge(c.scope, c.limit, used))
        try:
            raised = await self.store.lift(lifts) if lifts else 0
        except StoreUnavailable:
            self.failures += 1
            raise
        self.rebuilds += 1
        self.raised += raised
        if raised:
            log.warning("%d calendar budgets were below the spend ledger (a rate store "
                        "restart?): raised to what was spent", raised)
        return raised

    async def _sums(self, since: float) -> dict[str, float]:
        """Dollars spent since ``since`` by every scope a budget can name."""
        conn = await asyncpg.connect(self.url, timeout=self.timeout_s,
                                     command_timeout=self.timeout_s)
        try:
            rows = await conn.fetch(_SUMS, datetime.fromtimestamp(since, UTC))
        finally:
            with contextlib.suppress(Exception):
                await conn.close(timeout=self.timeout_s)
        out: dict[str, float] = defaultdict(float)
        for r in rows:
            d = float(r["dollars"] or 0.0)
            out[f"tenant:{r['tenant']}"] += d
            out[f"tenant:{r['tenant']}|model:{r['model']}"] += d
            out[f"model:{r['model']}"] += d
            if r["route"] is not None:
                out[f"route:{r['route']}"] += d
        return out
