"""Spend over sliding windows (``/admin/spend?window=1h``): what each tenant, key, model, tier
and agent session spent in the last minutes, hours or days, in dollars and tokens.

Spend is added to time buckets: minutes, with the session, kept ``MINUTES_KEPT_S``; hours,
without it, kept ``HOURS_KEPT_S``. A window is summed from whole buckets, the minutes for a
window up to ``MINUTES_KEPT_S`` (so it is exact to the minute), the hours beyond (exact to the
hour): the oldest bucket counts whole, and the answer says where the sum starts. Sessions
(``x-fairness-id``, chosen by clients, so unbounded) are kept only in the minute buckets.

With Redis, every replica adds its buckets to one hash per bucket (``{tokengate:spend}:m:…``,
``…:h:…``), batched with the daily totals and sent exactly once each; without, this replica's.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from gateway.redis_clients import Executor, add_to_hash

MINUTES_KEPT_S = 2 * 3600
HOURS_KEPT_S = 8 * 86400
MAX_WINDOW_S = 7 * 86400
WINDOW_GROUPS = ("tenant", "key", "model", "priority", "tier", "session")
FIELDS = ("requests", "prompt_tokens", "completion_tokens", "cached_tokens", "dollars")
SEP = "\x1f"
_WINDOW = re.compile(r"^(\d+)([smhd])$")
_UNIT = {"s": 1, "m": 60, "h": 3600, "d": 86400}
Row = list[float]
# tenant, key, model, priority, tier, session ("" in hour buckets and for no session)
Cell = tuple[str, str, str, str, str, str]


def parse_window(text: str) -> float | None:
    """``15m``, ``1h``, ``24h``, ``7d`` in seconds (None when malformed or beyond 7 days)."""
    m = _WINDOW.match(text.strip())
    if m is None:
        return None
    s = int(m.group(1)) * _UNIT[m.group(2)]
    return float(s) if 0 < s <= MAX_WINDOW_S else None


@dataclass(slots=True)
class _Series:
    """One bucket size: this replica's buckets (pruned past ``kept_s``) and what it has not
    yet sent."""

    prefix: str
    size_s: int
    kept_s: int
    sessions: bool
    local: dict[int, dict[Cell, Row]] = field(default_factory=dict)
    unsent: dict[int, dict[Cell, Row]] = field(default_factory=dict)

    def add(self, at: float, cell: Cell, amounts: Sequence[float]) -> None:
        b = int(at // self.size_s) * self.size_s
        if not self.sessions:
            cell = (*cell[:5], "")
        for table in (self.local, self.unsent):
            add_row(table.setdefault(b, {}), cell, amounts)
        oldest = b - self.kept_s
        for old in [k for k in self.local if k < oldest]:
            del self.local[old]

    def buckets(self, now: float, window_s: float) -> list[int]:
        last = int(now // self.size_s) * self.size_s
        first = int((now - window_s) // self.size_s) * self.size_s
        return list(range(first, last + 1, self.size_s))

    async def flush(self, redis: Executor) -> None:
        unsent, self.unsent = self.unsent, {}
        pending = sorted(unsent)
        for n, b in enumerate(pending):
            amounts = {SEP.join((*cell, name)): v for cell, row in unsent[b].items()
                       for name, v in zip(FIELDS, row, strict=True) if v}
            try:
                await add_to_hash(redis, f"{self.prefix}{b}", self.kept_s + self.size_s,
                                  amounts)
            except Exception:
                for later in pending[n:]:  # kept for the next flush, each amount sent once
                    for cell, row in unsent[later].items():
                        add_row(self.unsent.setdefault(later, {}), cell, row)
                raise

    async def read(self, redis: Executor | None, buckets: list[int]) -> dict[Cell, Row]:
        out: dict[Cell, Row] = {}
        for b in buckets:
            if redis is None:
                for cell, row in self.local.get(b, {}).items():
                    add_row(out, cell, row)
                continue
            raw = await redis.execute("HGETALL", f"{self.prefix}{b}")
            for i in range(0, len(raw) - 1, 2):
                k = raw[i].decode() if isinstance(raw[i], bytes) else raw[i]
                *parts, name = k.split(SEP)
                row = out.setdefault(tuple(parts), [0.0] * len(FIELDS))
                row[FIELDS.index(name)] += float(raw[i + 1])
        return out


class Windows:
    """The minute and hour buckets of spend."""

    def __init__(self, prefix: str) -> None:
        self.minutes = _Series(prefix + "m:", 60, MINUTES_KEPT_S, sessions=True)
        self.hours = _Series(prefix + "h:", 3600, HOURS_KEPT_S, sessions=False)

    def add(self, at: float, cell: Cell, amounts: Sequence[float]) -> None:
        self.minutes.add(at, cell, amounts)
        self.hours.add(at, cell, amounts)

    async def flush(self, redis: Executor) -> None:
        await self.minutes.flush(redis)
        await self.hours.flush(redis)

    def series(self, window_s: float) -> _Series:
        return self.minutes if window_s <= MINUTES_KEPT_S else self.hours

    async def spend(self, redis: Executor | None, now: float, window_s: float,
                    by: tuple[str, ...]) -> dict[str, Any]:
        """Rows summed by ``by`` over the window ending ``now``, largest spend first, and
        where the sum starts (the oldest bucket's start)."""
        s = self.series(window_s)
        buckets = s.buckets(now, window_s)
        cells = await s.read(redis, buckets)
        idx = [WINDOW_GROUPS.index(g) for g in by]
        sums: dict[tuple[str, ...], Row] = {}
        for cell, row in cells.items():
            add_row(sums, tuple(cell[i] for i in idx), row)
        rows = [{**{g: (v or None) if g == "session" else v
                    for g, v in zip(by, k, strict=True)},
                 **{f: (v if f == "dollars" else int(v))
                    for f, v in zip(FIELDS, acc, strict=True)}}
                for k, acc in sums.items()]
        return {"window_s": window_s, "from": float(buckets[0]), "to": now,
                "bucket_s": s.size_s, "rows": sorted(rows, key=lambda r: -r["dollars"])}


def add_row(table: dict[Any, Row], cell: Any, amounts: Sequence[float]) -> None:
    """Add ``amounts`` (one per ``FIELDS``) to ``table``'s row for ``cell``."""
    row = table.setdefault(cell, [0.0] * len(FIELDS))
    for i, v in enumerate(amounts):
        row[i] += v
