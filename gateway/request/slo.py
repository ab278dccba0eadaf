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
from dataclasses import dataclass

from gateway.config.policy import PRIORITY_RANK, Model, Route, Tenant
from gateway.routing.endpoints import EndpointState
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


@dataclass(frozen=True, slots=True)
class Step:
    """What to do with a request after its latest routing decision (``judge``): send it to
    ``decision``, wait until ``deadline`` and decide again, or answer ``error``; ``action``
    is the SLO action taken, for ``tokengate_slo_actions_total`` (None: none was needed)."""

    decision: Decision | None = None
    deadline: float | None = None
    error: APIError | None = None
    action: str | None = None


def judge(route: Route, m: Model, info: RequestInfo, decision: Decision | None, now: float,
          deadline: float | None = None) -> Step:
    """The SLO decision, a function of data and ``now`` alone: ``serve``, the EPP and the
    simulator take it on each routing decision. ``deadline`` is None on the first decision,
    else the one a previous ``Step`` set (the request has been waiting for a better one)."""
    if decision is None:
        return Step(error=APIError(502, f"no endpoint of {m.name} is available",
                                   type="server_error", code="upstream_unavailable"))
    if info.priority == "critical" or not misses(decision, info):
        return Step(decision, action="queued" if deadline is not None else None)
    action = "flex" if info.priority == "flex" else route.on_slo_miss
    if action in ("queue", "flex"):
        if deadline is None:
            return Step(deadline=now + route.queue_ms / 1000.0)
        if now < deadline:
            return Step(deadline=deadline)
        if action == "flex":
            return Step(action="shed", error=APIError(
                503, "the model is overloaded; flex-priority requests are shed first, retry "
                "later", type="service_unavailable", code="overloaded",
                headers={"retry-after": "2"}))
    elif action == "fallback" and route.failover and m.fallback:
        return Step(action="fallback", error=APIError(
            503, f"no endpoint of {m.name} is predicted to meet the SLO",
            type="service_unavailable", code="slo_unattainable"))
    return Step(decision, action="best_effort")


POLL_S = 0.02  # how often a waiting request's decision is taken again


async def decide(state: GatewayState, route: Route, m: Model, router: Router,
                 info: RequestInfo, exclude: Sequence[EndpointState] = ()
                 ) -> Decision | APIError:
    """Where the request goes (never to an endpoint of ``exclude``), holding it to its SLO
    as the route and priority say (``judge``), waiting in real time when it says so."""
    last = router.decide(info, exclude)
    step = judge(route, m, info, last, time.perf_counter())
    while step.deadline is not None:
        await asyncio.sleep(POLL_S)
        last = router.decide(info, exclude) or last
        step = judge(route, m, info, last, time.perf_counter(), step.deadline)
    if step.action is not None:
        state.metrics.series("slo_actions", m.name, info.priority, step.action).inc()
    if step.error is not None:
        return step.error
    assert step.decision is not None
    return step.decision
