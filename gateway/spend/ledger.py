"""What every request cost, counted once: ``SpendLedger.record`` takes one ``SpendRecord`` per
request and

* writes it to the spend log (logger ``tokengate.spend``, one JSON object per line) and to the
  sinks (``gateway.spend.postgres``), never waiting on them;
* adds it to the dollar and token counters in Prometheus (``tokengate_spend_dollars_total``,
  ``tokengate_spend_tokens_total``: tenant and model, both bounded by the policy);
* adds it to the spend by day, tenant, key, model, priority and tier that ``/admin/spend``
  reports:
  in this replica and, with Redis, in one hash per day that all replicas add to (batched every
  ``flush_s``; what could not be sent is kept for the next try), so any replica reports the
  whole fleet's spend.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from datetime import datetime
from typing import Any, Protocol
from zoneinfo import ZoneInfo

import orjson

from gateway.metrics import GatewayMetrics
from gateway.redis_clients import Executor, add_to_hash
from gateway.spend.record import SpendRecord
from gateway.spend.windows import FIELDS, SEP, Windows, add_row

log = logging.getLogger("tokengate.spend")
KEY = "{tokengate:spend}:"
TTL_S = 400 * 86400  # a day's spend is kept for a little over a year
GROUPS = ("day", "tenant", "key", "model", "priority", "tier")
Cell = tuple[str, str, str, str, str, str]  # day, tenant, key, model, priority, tier


class Sink(Protocol):
    def put(self, rec: SpendRecord) -> None: ...


class SpendLedger:
    def __init__(self, metrics: GatewayMetrics, *, time_zone: Callable[[], str] = lambda: "UTC",
                 tenant_label: Callable[[str], str] = lambda t: t,
                 log_records: Callable[[], bool] = lambda: True,
                 flush_s: float = 1.0) -> None:
        self.metrics = metrics
        self.time_zone = time_zone
        self.tenant_label = tenant_label
        self.log_records = log_records
        self.flush_s = flush_s
        self.sinks: list[Sink] = []
        self.redis: Executor | None = None
        self.totals: dict[Cell, list[float]] = {}  # this replica's, since it started
        self._unsent: dict[Cell, list[float]] = {}
        self.windows = Windows(KEY)  # minute and hour buckets: spend over sliding windows
        self.failures = 0
        self._day: tuple[str, int, str] = ("", -1, "")  # (time zone, minute, its day)

    def record(self, rec: SpendRecord) -> None:
        if self.log_records() and log.isEnabledFor(logging.INFO):
            # orjson writes the dataclass directly: 1.4 us, where asdict + json.dumps took 18,
            # and it was paid even when the logger dropped the line
            log.info("%s", orjson.dumps(rec).decode())
        for sink in self.sinks:
            sink.put(rec)
        tenant = self.tenant_label(rec.tenant)
        self.metrics.series("spend_dollars", tenant, rec.model).inc(rec.dollars)
        for kind, n in (("prompt", rec.prompt_tokens), ("completion", rec.completion_tokens),
                        ("cached", rec.cached_tokens)):
            if n:
                self.metrics.series("spend_tokens", tenant, rec.model, kind).inc(n)
        day = self.day(rec.at)
        cell = (day, rec.tenant, rec.key, rec.model, rec.priority, rec.tier)
        amounts = (1.0, float(rec.prompt_tokens), float(rec.completion_tokens),
                   float(rec.cached_tokens), rec.dollars)
        add_row(self.totals, cell, amounts)
        add_row(self._unsent, cell, amounts)
        self.windows.add(rec.at, (rec.tenant, rec.key, rec.model, rec.priority, rec.tier,
                                  rec.session or ""), amounts)

    def day(self, at: float) -> str:
        """The calendar day ``at`` falls in, in the policy's time zone (remembered for the
        minute: a day never begins within one)."""
        tz, minute = self.time_zone(), int(at // 60)
        if self._day[:2] != (tz, minute):
            self._day = (tz, minute, datetime.fromtimestamp(at, ZoneInfo(tz)).strftime(
                "%Y-%m-%d"))
        return self._day[2]

    # -- shared through Redis -----------------------------------------------------------------
    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.flush_s)
            await self.flush()

    async def flush(self) -> None:
        """Send what this replica added since the last flush, a day at a time; a day Redis
        did not take is kept for the next flush (each amount is sent exactly once)."""
        if self.redis is None:
            return
        try:
            await self.windows.flush(self.redis)
        except Exception as exc:  # any Redis failure: kept for a later flush
            self.failures += 1
            log.warning("spend windows not shared yet (Redis: %s); kept for the next flush",
                        exc)
        if not self._unsent:
            return
        unsent, self._unsent = self._unsent, {}
        days = sorted({c[0] for c in unsent})
        for n, day in enumerate(days):
            amounts = {SEP.join((*rest, name)): v for (d, *rest), row in unsent.items()
                       if d == day for name, v in zip(FIELDS, row, strict=True) if v}
            try:
                await add_to_hash(self.redis, KEY + day, TTL_S, amounts)
            except Exception as exc:  # any Redis failure: kept for a later flush
                self.failures += 1
                log.warning("spend totals not shared yet (Redis: %s); kept for the next "
                            "flush", exc)
                for cell, row in unsent.items():
                    if cell[0] in days[n:]:
                        add_row(self._unsent, cell, row)
                return

    async def cells(self, days: Iterable[str]) -> dict[Cell, list[float]]:
        """Spend per cell on ``days``: the fleet's (Redis) when shared, else this replica's."""
        wanted = set(days)
        if self.redis is None:
            return {c: r for c, r in self.totals.items() if c[0] in wanted}
        out: dict[Cell, list[float]] = {}
        for day in sorted(wanted):
            raw = await self.redis.execute("HGETALL", KEY + day)
            for i in range(0, len(raw) - 1, 2):
                k = raw[i].decode() if isinstance(raw[i], bytes) else raw[i]
                tenant, key, model, priority, tier, name = k.split(SEP)
                row = out.setdefault((day, tenant, key, model, priority, tier),
                                     [0.0] * len(FIELDS))
                row[FIELDS.index(name)] = float(raw[i + 1])
        return out


def group(cells: dict[Cell, list[float]], by: tuple[str, ...]) -> list[dict[str, Any]]:
    """Rows summed over every group not in ``by``, largest spend first."""
    idx = [GROUPS.index(g) for g in by]
    sums: dict[tuple[str, ...], list[float]] = {}
    for cell, row in cells.items():
        k = tuple(cell[i] for i in idx)
        acc = sums.setdefault(k, [0.0] * len(FIELDS))
        for i, v in enumerate(row):
            acc[i] += v
    rows = [{**dict(zip(by, k, strict=True)),
             **{f: (v if f == "dollars" else int(v)) for f, v in zip(FIELDS, acc, strict=True)}}
            for k, acc in sums.items()]
    return sorted(rows, key=lambda r: -r["dollars"])
