"""The admin endpoints (``/admin/*``), behind the admin key: the policy as resolved, the
endpoints, the limiter's buckets, flow control, spend, the predictor, scaling, and drain."""

from __future__ import annotations

import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict
from typing import Any

import orjson
from aiohttp import web

from gateway.config.resolved import resolved
from gateway.flow import view as flow_view
from gateway.front.reload import PolicyWatcher
from gateway.quota import ledger as quota
from gateway.quota.limiter.resilient import ResilientStore
from gateway.quota.limiter.store import StoreUnavailable
from gateway.request import pipeline
from gateway.routing.endpoints import EndpointState
from gateway.spend.ledger import GROUPS, group
from gateway.spend.windows import MINUTES_KEPT_S, WINDOW_GROUPS, parse_window
from gateway.state import GATEWAY, GatewayState
from predictor.online import summary
from protocol.bodies import json_object
from protocol.errors import APIError

_DIGITS = re.compile(r"[0-9]{1,6}\Z")
_DAY = re.compile(r"[0-9]{4}-[0-9]{2}-[0-9]{2}\Z")

WATCHER: web.AppKey[PolicyWatcher] = web.AppKey("tokengate_policy_watcher", PolicyWatcher)


def json_text(o: Any) -> str:
    """JSON for an answer (whatever is not JSON as its string)."""
    return orjson.dumps(o, default=str).decode()


def admin(request: web.Request) -> GatewayState:
    """The gateway's state, for a request that carries the admin key (401 otherwise)."""
    state = request.app[GATEWAY]
    digest = state.view.admin_digest
    if digest is None:
        s = state.view.policy.settings
        where = (f"set the environment variable {s.admin_key_env} before the gateway starts"
                 if s.admin_key_env else "set settings.admin_key_env or admin_key_sha256")
        raise APIError(401, f"admin endpoints are off: no admin key is configured ({where})",
                       code="invalid_api_key")
    if not pipeline.key_matches(pipeline.bearer(request.headers), digest):
        where = (f"the key in the gateway's environment variable {s.admin_key_env}"
                 if (s := state.view.policy.settings).admin_key_env and not s.admin_key_sha256
                 else "the key whose SHA-256 is settings.admin_key_sha256")
        raise APIError(401, f"admin endpoints need the admin key ({where}) as 'Authorization: "
                       "Bearer KEY'", code="invalid_api_key")
    return state


async def admin_policy(request: web.Request) -> web.Response:
    state = admin(request)
    out = resolved(state.view.policy)
    watcher = request.app.get(WATCHER)
    if watcher is not None:
        out["last_reload_error"] = watcher.last_error
    return web.json_response(out, dumps=json_text)


async def admin_endpoints(request: web.Request) -> web.Response:
    state = admin(request)
    view = state.view
    out = {name: {"strategy": view.routers[name].strategy,
                  "index": view.policy.models[name].routing.index,
                  "endpoints": [
                      {"url": e.url, "role": e.role, "hardware": e.hardware,
                       "in_flight": e.live.in_flight, "prefill_tokens": e.live.prefill_tokens,
                       "decoding": e.live.decoding, "tokens_outstanding": e.live.tokens_outstanding,
                       "step_ms": e.live.current_step_ms(time.monotonic()),
                       "routed": e.live.routed, "served": e.health.served,
                       "failed": e.health.failed,
                       "healthy": e.healthy(time.monotonic()), "waiting": e.engine.waiting,
                       "running": e.engine.running, "kv_usage": e.engine.kv_usage,
                       "resident_models": sorted(e.engine.resident),
                       "lora_adapters": state.fleet.adapters.listed(e.url),
                       "model_wait_s": e.engine.model_wait_s,
                       "block_size": e.engine.block_size, "num_gpu_blocks": e.engine.num_gpu_blocks,
                       "index_blocks": (state.fleet.precise if view.routers[name].precise
                                        else state.fleet.approx).size(e.url),
                       **_engine_fields(state, e)}
                      for e in pool.endpoints]}
           for name, pool in view.pools.items()}
    return web.json_response(out, dumps=json_text)


def _engine_fields(state: GatewayState, e: EndpointState) -> dict[str, Any]:
    """What the engine says of itself (its /metrics and /v1/models), and its KV event stream."""
    v = e.engine
    sub = state.fleet.kv_events.subscribers.get(e.url)
    return {"engine": {
        "prefix_cache_queries": v.prefix_queries, "prefix_cache_hits": v.prefix_hits,
        "prompt_tokens_cached": v.prompt_tokens_cached,
        "external_prefix_cache_queries": v.external_prefix_queries,
        "external_prefix_cache_hits": v.external_prefix_hits,
        "preemptions": v.preemptions, "waiting_by_reason": v.waiting_by_reason,
        "max_model_len": v.max_model_len,
        "kv_tiers": {"host_blocks": v.host_blocks, "host_seconds_per_token": v.host_s_per_token,
                     "host_blocks_indexed": max(state.fleet.precise.size(e.url, "CPU"),
                                                state.fleet.tiers.approx_host.size(e.url)),
                     "pool": v.pool_s_per_token is not None,
                     "pool_seconds_per_token": v.pool_s_per_token},
        "scraped_ago_s": round(time.monotonic() - v.scraped_at, 3) if v.scraped_at else None},
        "kv_events": None if sub is None else {
            "endpoint": sub.config.endpoint, "replay": sub.config.replay,
            **asdict(sub.stats)}}


async def admin_predictor(request: web.Request) -> web.Response:
    state = admin(request)
    out = summary(state.predictor)
    sync = state.sync
    out["shared"] = None if sync is None else {"leader": sync.leader, "id": sync.id}
    return web.json_response(out, dumps=json_text)


async def admin_scaling(request: web.Request) -> web.Response:
    state = admin(request)
    return web.json_response({n: s.summary() for n, s in state.scalers.items()},
                             dumps=json_text)


async def admin_drain(request: web.Request) -> web.Response:
    """``{"url": ENDPOINT}``: take the endpoint out of rotation and move its streams (in pools
    that scale) to other endpoints; ``{"url": ..., "undrain": true}`` puts it back."""
    state = admin(request)
    body = await json_object(request)
    url = body.get("url")
    e = state.fleet.endpoints.get(url) if isinstance(url, str) else None
    if e is None:
        raise APIError(404, f"no endpoint {url!r}", param="url", code="endpoint_not_found")
    if body.get("undrain") is True:
        e.health.draining = False
        return web.json_response({"url": e.url, "draining": False})
    e.health.draining = True
    moved = state.live.migrate_from(e.url)
    return web.json_response({"url": e.url, "draining": True, "streams_moved": moved,
                              "in_flight": e.live.in_flight})


async def admin_limiter(request: web.Request) -> web.Response:
    """The store, and every bucket the policy sets: its limit, what is left, when it is full
    again (the fullest first)."""
    state = admin(request)
    store = state.store
    out: dict[str, Any] = {"store": type(store).__name__,
                           "round_trips": store.stats.round_trips}
    try:
        states = await store.peek(quota.every_bucket(state.view.policy))
    except StoreUnavailable:
        states = []
        out["buckets_unavailable"] = "the rate store cannot be reached"
    out["buckets"] = sorted(({
        "scope": s.scope, "kind": s.limit.kind, "limit": s.limit.amount,
        "period_s": None if s.limit.expires_at is not None else s.limit.period_s,
        "burst": s.limit.burst, "remaining": s.remaining, "used": s.limit.burst - s.remaining,
        "resets_in_s": (max(0.0, s.limit.expires_at - time.time())
                        if s.limit.expires_at is not None else s.reset_s)}
        for s in states), key=lambda b: b["remaining"] / b["burst"])
    if isinstance(store, ResilientStore):
        st = store.primary.stats  # the shared store's (a lease store shares its stats)
        out.update(primary=type(store.primary).__name__, degraded=store.degraded,
                   fail_open=store.fail_open, owed=st.owed, compensated=st.compensated,
                   abandoned=st.abandoned, replicas=store.replicas)
    return web.json_response(out, dumps=json_text)


async def admin_flow(request: web.Request) -> web.Response:
    """Flow control now: what waits, per band and flow, each flow's fair-share counter (the
    ``limit`` most served, default 50; only ``flow``'s when given: a tenant or one flow), and
    whether the counters are shared with the other replicas (``gateway.flow.view``)."""
    state = admin(request)
    raw = request.query.get("limit", str(flow_view.LIMIT))
    # ASCII digits only: str.isdigit also takes "²" and other digits int() refuses
    if not (_DIGITS.match(raw) and 1 <= int(raw) <= 10_000):
        raise APIError(400, "limit must be an integer from 1 to 10000", param="limit",
                       code="invalid_value")
    return web.json_response(flow_view.snapshot(state.flow, state.flow_share, int(raw),
                                                request.query.get("flow") or None),
                             dumps=json_text)


async def admin_spend(request: web.Request) -> web.Response:
    """Spend summed by ``by`` (any of ``GROUPS``; default tenant) over
    ``days`` (YYYY-MM-DD, comma-separated; default today in the policy's time zone)."""
    state = admin(request)
    by = tuple(x for x in request.query.get("by", "tenant").split(",") if x)
    if "window" in request.query:
        return await _spend_window(state, request.query["window"], by)
    bad_by = [x for x in by if x not in GROUPS]
    if bad_by or not by:
        raise APIError(400, f"by must name some of {', '.join(GROUPS)}", param="by",
                       code="invalid_value")
    days = [d for d in request.query.get("days", "").split(",") if d] or \
        [state.spend.day(time.time())]
    if len(days) > 400 or not all(_DAY.match(d) for d in days):
        raise APIError(400, "days must be up to 400 dates as YYYY-MM-DD", param="days",
                       code="invalid_value")
    cells = await state.spend.cells(days)
    return web.json_response({"by": list(by), "days": days,
                              "shared": state.spend.redis is not None,
                              "rows": group(cells, by)}, dumps=json_text)


async def _spend_window(state: GatewayState, window: str, by: tuple[str, ...]
                        ) -> web.Response:
    """Spend over the last ``window`` (``15m``, ``1h``, ``7d``), by any of
    ``WINDOW_GROUPS`` (sessions only within ``MINUTES_KEPT_S``)."""
    window_s = parse_window(window)
    if window_s is None:
        raise APIError(400, "window must be a duration like 15m, 1h or 7d, at most 7d",
                       param="window", code="invalid_value")
    if not by or any(x not in WINDOW_GROUPS for x in by):
        raise APIError(400, f"with window, by must name some of {', '.join(WINDOW_GROUPS)}",
                       param="by", code="invalid_value")
    if "session" in by and window_s > MINUTES_KEPT_S:
        raise APIError(400, f"spend by session is kept for windows up to "
                       f"{MINUTES_KEPT_S // 3600}h", param="window", code="invalid_value")
    out = await state.spend.windows.spend(state.spend.redis, time.time(), window_s, by)
    return web.json_response({"by": list(by), **out, "shared": state.spend.redis is not None},
                             dumps=json_text)


async def admin_index(request: web.Request) -> web.Response:
    """``GET /admin``: every admin route, its method and what it answers."""
    admin(request)
    return web.json_response({"routes": [{"method": m, "path": p, "description": d}
                                         for m, p, _, d in ROUTES]}, dumps=json_text)


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
# The admin routes (method, path, handler, what it answers): ``build_app`` registers them and
# ``GET /admin`` lists them, so the index cannot miss one.
ROUTES: tuple[tuple[str, str, Handler, str], ...] = (
    ("GET", "/admin", admin_index, "this list"),
    ("GET", "/admin/policy", admin_policy,
     "the policy in force as resolved (secrets shown as ***), its source and the last "
     "reload error"),
    ("GET", "/admin/endpoints", admin_endpoints,
     "each endpoint: health, load, engine metrics, cache, KV event streams"),
    ("GET", "/admin/limiter", admin_limiter,
     "the rate store: its state, round trips, owed and compensated settlement steps, leases"),
    ("GET", "/admin/spend", admin_spend,
     "spend summed by day, tenant, key, model, priority and tier (?day=, ?group=), or over a "
     "sliding window (?window=1h)"),
    ("GET", "/admin/flow", admin_flow, "flow control: queues, flows and their shares"),
    ("GET", "/admin/predictor", admin_predictor, "the latency predictor: models and errors"),
    ("GET", "/admin/scaling", admin_scaling, "each scaled pool's state"),
    ("POST", "/admin/drain", admin_drain,
     'take an endpoint out of rotation and move its streams: {"url": "http://.../v1"} '
     '(back: "undrain": true)'),
)
