"""``settings.sentry``: the cost sentry's limits on agent sessions (``gateway.spend.sentry``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gateway.config import schema
from gateway.config.decode import Decoder


@dataclass(frozen=True, slots=True)
class SentryConfig:
    session_budget: float | None = None  # dollars one session may spend (exact, hard)
    session_ttl_s: float = 86_400.0  # a session's spend is kept this long after its last use
    repeat_limit: int | None = None  # the same body this many times in the window: stopped
    repeat_window_s: float = 600.0
    velocity_factor: float | None = None  # spending this many times the usual: throttled
    velocity_window_s: float = 60.0


def parse_sentry(d: Decoder, raw: Any, path: str) -> SentryConfig:
    m = d.mapping(raw, path, schema.keys("sentry"))
    kw: dict[str, Any] = {}
    if "repeat_limit" in m:
        kw["repeat_limit"] = d.integer(m["repeat_limit"], f"{path}.repeat_limit")
    kw.update(d.fields(m, path, ("session_budget", "session_ttl_s", "repeat_window_s",
                                 "velocity_factor", "velocity_window_s"), d.number))
    return SentryConfig(**kw)
