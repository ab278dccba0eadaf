"""A gateway over given upstream URLs whose rate store is a frozen-clock MemoryStore, so what
the buckets hold is exactly what was charged (nothing refills), and the readers of it."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from gateway_stack import RunningGateway, start_gateway, write_policy

from gateway.quota.limiter.memory import MemoryStore

NOW = 1_000_000.0
TPD = 10_000_000.0
RPD = 1_000_000.0  # requests per day, as a budget-free bucket: rpm with a day's period
AUTH = {"Authorization": "Bearer k"}


def sha(key: str) -> str:
    import hashlib

    return hashlib.sha256(key.encode()).hexdigest()


def policy(urls: list[str], *, model: dict[str, Any] | None = None,
           route: dict[str, Any] | None = None, settings: dict[str, Any] | None = None,
           rpm: float = 1_000_000.0) -> dict[str, Any]:
    return {"version": 1, "settings": {"expose_endpoints": True, **(settings or {})},
            "models": {"m": {"endpoints": [{"url": u} for u in urls], "default_max_tokens": 16,
                             "upstream_model": "up", "routing": {"strategy": "round_robin"},
                             **(model or {})}},
            "tenants": {"t": {"keys": [{"sha256": sha("k")}],
                              "limits": {"tpd": TPD, "rpm": rpm}}},
            "routes": {"r": {"tenants": ["t"], "models": ["m"], **(route or {})}}}


def ledger_gateway(tmp: Path, doc: dict[str, Any]) -> RunningGateway:
    gw = start_gateway(write_policy(tmp / f"p{time.monotonic_ns()}.yaml", doc))
    gw.state.store = MemoryStore(clock=lambda: NOW)
    return gw


def settled(gw: RunningGateway, timeout_s: float = 10.0) -> None:
    """Wait until nothing is in flight or settling, three polls in a row."""
    deadline = time.monotonic() + timeout_s
    quiet = 0
    while quiet < 3 and time.monotonic() < deadline:
        busy = gw.state.background or any(e.live.in_flight
                                          for e in gw.state.fleet.endpoints.values())
        quiet = 0 if busy else quiet + 1
        time.sleep(0.02)


def charged(gw: RunningGateway) -> tuple[float, float]:
    """(tokens, requests) the tenant's buckets hold, once everything has settled."""
    settled(gw)
    store = gw.state.store
    assert isinstance(store, MemoryStore)
    tat = store._tat
    tokens = (tat.get(("tenant:t", "tokens_day"), NOW) - NOW) / (86400.0 / TPD)
    limit = gw.state.view.policy.tenants["t"].limits.rpm
    assert limit is not None
    requests = (tat.get(("tenant:t", "requests"), NOW) - NOW) / (60.0 / limit)
    return round(tokens, 6), round(requests, 6)
