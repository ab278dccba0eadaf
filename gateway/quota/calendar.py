"""Calendar budgets: dollars per day or per month that reset at midnight (or on the 1st) in the
policy's time zone, beside the rolling ``budget``. Each window is its own bucket: the charge's
scope names the window (``tenant:acme@2026-12-02``), its limit does not refill within it
(``bucket.spend_cap``: the bucket holds the dollars spent, so a new cap never rescales them)
and expires at the window's end, so a reservation made before midnight settles in the window
it was made in, and the next window starts full."""

from __future__ import annotations

from datetime import datetime, timedelta
from zoneinfo import ZoneInfo

from gateway.quota.limiter.bucket import Kind, Limit, spend_cap


def window(kind: Kind, now: float, tz: str) -> tuple[str, float]:
    """The window ``now`` falls in: its label and its end (epoch seconds)."""
    local = datetime.fromtimestamp(now, ZoneInfo(tz))
    if kind == "budget_daily":
        start = local.replace(hour=0, minute=0, second=0, microsecond=0)
        # the next midnight, also across a DST change (the day may be 23 or 25 hours long)
        nxt = (start + timedelta(days=1, hours=2)).replace(hour=0)
        return start.strftime("%Y-%m-%d"), nxt.timestamp()
    start = local.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    nxt = (start + timedelta(days=32)).replace(day=1)
    return start.strftime("%Y-%m"), nxt.timestamp()


def start(kind: Kind, now: float, tz: str) -> float:
    """When the window ``now`` falls in began (epoch seconds)."""
    local = datetime.fromtimestamp(now, ZoneInfo(tz))
    first = local.replace(hour=0, minute=0, second=0, microsecond=0)
    if kind != "budget_daily":
        first = first.replace(day=1)
    return first.timestamp()


def limit(kind: Kind, dollars: float, now: float, tz: str) -> tuple[str, Limit]:
    """The scope suffix and bucket of a calendar budget of ``dollars`` at ``now``."""
    label, end = window(kind, now, tz)
    return f"@{label}", spend_cap(kind, dollars, end)
