"""Reserving a request's quota on one model (and, when the route allows, down its fallback
chain): the one place a reservation is made for a request, by the pipeline's first admission
and by ``dispatch``'s fallback after an upstream failure alike. A rate store that cannot be
reached is a 503 ``limiter_unavailable`` (under ``fail_closed``; ``fail_open`` never raises),
counted in the limiter metrics, and every refusal on the way is counted too."""

from __future__ import annotations

from gateway.config.policy import Model
from gateway.quota import ledger as quota
from gateway.quota.limiter.resilient import Uncounted
from gateway.quota.limiter.store import StoreUnavailable
from gateway.request.context import RequestContext
from gateway.state import GatewayState
from protocol.errors import APIError


def limiter_unavailable(message: str = "rate limiting is unavailable") -> APIError:
    return APIError(503, message, type="service_unavailable", code="limiter_unavailable",
                    headers={"retry-after": "1"})


async def reserve(state: GatewayState, ctx: RequestContext, model: Model) -> quota.Admission:
    """``quota.admit`` on ``model`` for this request, counted in the limiter metrics; every
    admission it makes is recorded in ``ctx.admissions`` (settled whatever happens after).
    Raises the 503 of an unreachable store; returns refusals (``decision.allowed`` False)."""
    try:
        adm = await quota.admit(state.store, ctx.view.policy, ctx.tenant, ctx.route, model,
                                ctx.count_prompt, ctx.expected_output, ctx.session,
                                floor_prompt=ctx.floor_prompt)
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
