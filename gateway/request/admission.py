"""Reserving a request's quota on one model (and, when the route allows, down its fallback
chain): the one place a reservation is made for a request, by the pipeline's first admission
and by ``dispatch``'s fallback after an upstream failure alike. A rate store that cannot be
reached is a 503 ``limiter_unavailable`` (under ``fail_closed``; ``fail_open`` never raises),
counted in the limiter metrics, and every refusal on the way is counted too."""

from __future__ import annotations

from gateway import clock as clk
from gateway.config.policy import Model
from gateway.quota import ledger as quota
from gateway.quota.limiter.resilient import Uncounted
from gateway.quota.limiter.store import Charge, StoreUnavailable
from gateway.request.context import RequestContext
from gateway.state import GatewayState
from protocol.errors import APIError


def limiter_unavailable(message: str = "rate limiting is unavailable") -> APIError:
    return APIError(503, message, type="service_unavailable", code="limiter_unavailable",
                    headers={"retry-after": "1"})


async def reserve(state: GatewayState, ctx: RequestContext, model: Model) -> quota.Admission:
    """``quota.admit`` on ``model`` for this request, counted in the limiter metrics; every
    admission it makes is recorded in ``ctx.admissions`` (settled whatever happens after).
    Raises the 503 of an unreachable store; returns refusals (``decision.allowed`` False).
    The tenant's reserved throughput on the model it lands on rides the same store call
    (``quota.tier_charges``); ``quota.tier_of`` reads the request's tier off the decision, set
    by the caller that adopts the admission (``adopt``)."""
    try:
        adm = await quota.admit(state.store, ctx.view.policy, ctx.tenant, ctx.route, model,
                                ctx.count_prompt, ctx.expected_output, ctx.session,
                                floor_prompt=ctx.floor_prompt,
                                optional=lambda m, tokens: _tier(state, ctx, m, tokens))
    except StoreUnavailable as exc:
        state.metrics.series("limiter", "all", "unavailable").inc()
        # the store's own words only when they are ours to show (never its address)
        raise limiter_unavailable(*((str(exc),) if isinstance(exc, Uncounted) else ())
                                  ) from None
    finally:
        if state.store.stats.fallbacks:
            state.metrics.limiter_fallbacks.inc(state.store.stats.fallbacks)
            state.store.stats.fallbacks = 0
    for refused in adm.refused:
        if refused.denied is not None:
            state.metrics.series("limiter", refused.denied.scope.split(":")[0], "denied").inc()
    denied = adm.decision.denied
    if denied is not None and denied.limit.kind == "session_budget":
        state.sentry.capped(ctx.tenant, denied.scope)
    if adm.decision.allowed:
        ctx.admissions.append(adm)
        state.metrics.series("limiter", "all", "admitted").inc()
    return adm


def adopt(ctx: RequestContext, adm: quota.Admission) -> quota.Admission:
    """``adm`` is the one the request goes on with: its tier is the request's."""
    ctx.tier = quota.tier_of(ctx.priority, adm.decision)
    return adm


def _tier(state: GatewayState, ctx: RequestContext, model: Model, tokens: int
          ) -> list[Charge]:
    """The tier charge (``quota.tier_charges``), the pool's healthy endpoints counted only
    for a reservation given as a share of it."""
    share = model.name in ctx.view.policy.tenants[ctx.tenant].reserved_share
    return quota.tier_charges(ctx.view.policy, ctx.tenant, model, ctx.priority, tokens,
                              healthy_endpoints(state, model.name) if share else 0)


def healthy_endpoints(state: GatewayState, model: str) -> int:
    pool = state.view.pools.get(model)
    if pool is None:
        return 0
    now = clk.now()
    return sum(1 for e in pool.endpoints if e.healthy(now))
