"""What the gateway's scrape reads of a simulated engine's lower KV tiers (the backend's
``tokengate_backend_kv_tier_info`` gauge), read once: tiers do not change during a run."""

from __future__ import annotations

from gateway.routing.endpoints import EngineView
from gateway.routing.tiers import TierIndex
from simulator.engine import SimEngine


def tier_view(eng: SimEngine, v: EngineView, tiers: TierIndex, pool_url: str | None) -> None:
    if eng.cost is None:
        return
    v.block_bytes = eng.block_bytes
    if eng.host is not None:
        v.host_blocks = eng.host.capacity
        v.host_s_per_token = eng.cost.host_seconds_per_token()
        tiers.set_host_capacity(eng.url, eng.host.capacity)
    if eng.kv_pool is not None and pool_url is not None:
        v.pool_s_per_token = eng.cost.pool_seconds_per_token()
        v.pool_latency_s = eng.cost.link_latency_s
        tiers.set_pool_capacity(pool_url, max(eng.kv_pool.capacity_bytes // eng.block_bytes, 1))
