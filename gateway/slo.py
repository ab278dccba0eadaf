"""Per-request SLOs and priority classes, applied to a routing decision.

``x-slo-ttft-ms`` / ``x-slo-tpot-ms`` (defaults per route) and ``x-priority: critical |
standard | flex`` (default per tenant, and capped by it: a header can lower a tenant's band,
never raise it past its policy's ``max_priority``). A request that no endpoint is predicted to
serve within its SLO is routed best-effort, queued up to the route's ``queue_ms`` while the
decision is re-taken, or failed over to the fallback model (``code: slo_unattainable`` tells
the pipeline to walk the chain), as the route's ``on_slo_miss`` says. Critical requests are
never held back; flex requests wait while the pool is predicted over its SLO
(``FLEX_OVERLOAD_MS`` without one) and are then shed first, with 503 and ``retry-after``.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Mapping, Sequence

from gateway.config.policy import PRIORITY_RANK, Model, Route, Tenant
from gateway.endpoints import EndpointState
from gateway.routing.plugins import RequestInfo
from gateway.routing.router import Decision, Router
from gateway.state import GatewayState
from protocol.errors import APIError, bad

FLEX_OVERLOAD_MS = 2000.0


def header(headers: Mapping[str, str], name: str, default: float | None) -> float | None:
    raw = headers.get(name)
    if raw is None:
        return default
    try:
        v = float(raw)
    except ValueError:
        v = -1.0
    if not math.isfinite(v) or v <= 0:
        raise bad(f"header {name} must be a positive number of milliseconds, got {raw!r}",
                  name)
    return v


def priority(headers: Mapping[str, str], tenant: Tenant) -> str:
    """The request's band: ``x-priority`` (or an InferenceObjective, which the EPP reads as
    one) may lower the tenant's ``priority``, never raise it above its ceiling (the policy's
    ``max_priority``, else its ``priority``): a higher band asked for is served at the
    ceiling."""
    raw = headers.get("x-priority")
    if raw is None:
        return tenant.priority
    if raw not in PRIORITY_RANK:
        raise bad(f"header x-priority must be critical, standard or flex, got {raw!r}",
                  "x-priority")
    ceiling = tenant.priority_ceiling
    return raw if PRIORITY_RANK[raw] <= PRIORITY_RANK[ceiling] else ceiling


def misses(d: Decision, info: RequestInfo) -> bool:
    ttft_slo = info.slo_ttft_ms
    if info.priority == "flex" and ttft_slo is None:
        ttft_slo = FLEX_OVERLOAD_MS
    return bool((ttft_slo is not None and d.predicted_ttft_ms > ttft_slo)
                or (info.slo_tpot_ms is not None and d.predicted_tpot_ms > info.slo_tpot_ms))


async def decide(state: GatewayState, route: Route, m: Model, router: Router,
                 info: RequestInfo, exclude: Sequence[EndpointState] = ()
                 ) -> Decision | APIError:
    """Where the request goes (never to an endpoint of ``exclude``), holding it to its SLO
    as the route and priority say."""
    decision = router.decide(info, exclude)
    if decision is None:
        return APIError(502, f"no endpoint of {m.name} is available", type="server_error",
                        code="upstream_unavailable")
    if info.priority == "critical" or not misses(decision, info):
        return decision
    action = "flex" if info.priority == "flex" else route.on_slo_miss
    if action in ("queue", "flex"):
        deadline = time.perf_counter() + route.queue_ms / 1000.0
        while time.perf_counter() < deadline:
            await asyncio.sleep(0.02)
            decision = router.decide(info, exclude) or decision
            if not misses(decision, info):
                state.metrics.series("slo_actions", m.name, info.priority, "queued").inc()
                return decision
        if action == "flex":
            state.metrics.series("slo_actions", m.name, info.priority, "shed").inc()
            return APIError(503, "the model is overloaded; flex-priority requests are shed "
                            "first, retry later", type="service_unavailable", code="overloaded",
                            headers={"retry-after": "2"})
    elif action == "fallback" and route.failover and m.fallback:
        state.metrics.series("slo_actions", m.name, info.priority, "fallback").inc()
        return APIError(503, f"no endpoint of {m.name} is predicted to meet the SLO",
                        type="service_unavailable", code="slo_unattainable")
    state.metrics.series("slo_actions", m.name, info.priority, "best_effort").inc()
    return decision
