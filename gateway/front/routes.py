"""The gateway's HTTP application: routes, auth for admin, lifecycle. Wiring only."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import hmac
import logging
import os
import re
import time
from collections.abc import AsyncIterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import orjson
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from gateway.config.resolved import resolved
from gateway.flow import view as flow_view
from gateway.flow.share import CounterShare
from gateway.front import openapi
from gateway.front.http_guard import SERVER, guard
from gateway.front.reload import PolicyWatcher
from gateway.quota import ledger as quota
from gateway.quota.limiter.resilient import ResilientStore
from gateway.quota.limiter.store import StoreUnavailable
from gateway.redis_clients import coordination_client
from gateway.request import embeddings, pipeline
from gateway.routing.endpoints import EndpointState
from gateway.routing.prefix_hints import PrefixShare
from gateway.spend.ledger import GROUPS, group
from gateway.spend.postgres import PostgresSink
from gateway.spend.rebuild import BudgetRebuild
from gateway.spend.windows import MINUTES_KEPT_S, WINDOW_GROUPS, parse_window
from gateway.state import GATEWAY, GatewayState
from predictor.online import summary
from predictor.sync import ModelSync
from protocol.bodies import json_object
from protocol.errors import APIError, errors

log = logging.getLogger("tokengate.gateway")
_DIGITS = re.compile(r"[0-9]{1,6}\Z")
_DAY = re.compile(r"[0-9]{4}-[0-9]{2}-[0-9]{2}\Z")

WATCHER: web.AppKey[PolicyWatcher] = web.AppKey("tokengate_policy_watcher", PolicyWatcher)


def _dumps(o: Any) -> str:
    return orjson.dumps(o, default=str).decode()


async def models(request: web.Request) -> web.Response:
    state = request.app[GATEWAY]
    policy = state.view.policy
    tenant = pipeline.authenticate(request.headers, policy)
    data = [{"id": m, "object": "model", "created": 0, "owned_by": "tokengate"}
            for m in policy.models_for(tenant)]
    return web.json_response({"object": "list", "data": data}, dumps=_dumps)


async def openapi_json(request: web.Request) -> web.Response:
    limit = request.app[GATEWAY].view.policy.settings.max_messages
    return web.Response(body=_openapi(limit), content_type="application/json")


@functools.cache
def _openapi(max_messages: int) -> bytes:
    return orjson.dumps(openapi.document(max_messages))


async def health(request: web.Request) -> web.Response:
    return web.Response(text="ok")


async def ready(request: web.Request) -> web.Response:
    state = request.app[GATEWAY]
    if state.draining:
        return web.Response(status=503, text="draining")
    if not state.discoverer.ready():
        return web.Response(status=503, text="discovering endpoints")
    return web.Response(text="ready")


async def metrics(request: web.Request) -> web.Response:
    state = request.app[GATEWAY]
    if not state.view.policy.settings.public_metrics and state.view.admin_digest is not None:
        _admin(request)
    # Models trained since the last scrape (the predictor counts; the counter follows).
    trained = state.predictor.trainings - state.metrics.trainings_seen
    if trained > 0:
        state.metrics.predictor_trainings.inc(trained)
        state.metrics.trainings_seen = state.predictor.trainings
    body = generate_latest(state.metrics.registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


def _admin(request: web.Request) -> GatewayState:
    state = request.app[GATEWAY]
    digest = state.view.admin_digest
    token = pipeline.bearer(request.headers)
    got = hashlib.sha256(token.encode("utf-8", "surrogateescape")).hexdigest() if token else ""
    if digest is None:
        s = state.view.policy.settings
        where = (f"set the environment variable {s.admin_key_env} before the gateway starts"
                 if s.admin_key_env else "set settings.admin_key_env or admin_key_sha256")
        raise APIError(401, f"admin endpoints are off: no admin key is configured ({where})",
                       code="invalid_api_key")
    if not hmac.compare_digest(got, digest):
        where = (f"the key in the gateway's environment variable {s.admin_key_env}"
                 if (s := state.view.policy.settings).admin_key_env and not s.admin_key_sha256
                 else "the key whose SHA-256 is settings.admin_key_sha256")
        raise APIError(401, f"admin endpoints need the admin key ({where}) as 'Authorization: "
                       "Bearer KEY'", code="invalid_api_key")
    return state


async def admin_policy(request: web.Request) -> web.Response:
    state = _admin(request)
    out = resolved(state.view.policy)
    watcher = request.app.get(WATCHER)
    if watcher is not None:
        out["last_reload_error"] = watcher.last_error
    return web.json_response(out, dumps=_dumps)


async def admin_endpoints(request: web.Request) -> web.Response:
    state = _admin(request)
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
    return web.json_response(out, dumps=_dumps)


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
    state = _admin(request)
    out = summary(state.predictor)
    sync = state.sync
    out["shared"] = None if sync is None else {"leader": sync.leader, "id": sync.id}
    return web.json_response(out, dumps=_dumps)


async def admin_scaling(request: web.Request) -> web.Response:
    state = _admin(request)
    return web.json_response({n: s.summary() for n, s in state.scalers.items()},
                             dumps=_dumps)


async def admin_drain(request: web.Request) -> web.Response:
    """``{"url": ENDPOINT}``: take the endpoint out of rotation and move its streams (in pools
    that scale) to other endpoints; ``{"url": ..., "undrain": true}`` puts it back."""
    state = _admin(request)
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
    state = _admin(request)
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
                   abandoned=st.abandoned)
    return web.json_response(out, dumps=_dumps)


async def admin_flow(request: web.Request) -> web.Response:
    """Flow control now: what waits, per band and flow, each flow's fair-share counter (the
    ``limit`` most served, default 50; only ``flow``'s when given: a tenant or one flow), and
    whether the counters are shared with the other replicas (``gateway.flow.view``)."""
    state = _admin(request)
    raw = request.query.get("limit", str(flow_view.LIMIT))
    # ASCII digits only: str.isdigit also takes "²" and other digits int() refuses
    if not (_DIGITS.match(raw) and 1 <= int(raw) <= 10_000):
        raise APIError(400, "limit must be an integer from 1 to 10000", param="limit",
                       code="invalid_value")
    return web.json_response(flow_view.snapshot(state.flow, state.flow_share, int(raw),
                                                request.query.get("flow") or None),
                             dumps=_dumps)


async def admin_spend(request: web.Request) -> web.Response:
    """Spend summed by ``by`` (any of ``GROUPS``; default tenant) over
    ``days`` (YYYY-MM-DD, comma-separated; default today in the policy's time zone)."""
    state = _admin(request)
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
                              "rows": group(cells, by)}, dumps=_dumps)


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
                             dumps=_dumps)


async def _lifecycle(app: web.Application) -> AsyncIterator[None]:
    state = app[GATEWAY]
    watcher = app.get(WATCHER)
    tasks = [asyncio.ensure_future(watcher.run())] if watcher is not None else []
    tasks.append(asyncio.ensure_future(state.fleet.scrape_loop()))
    tasks.append(asyncio.ensure_future(state.discoverer.run()))
    sync = None
    share = None
    if state.redis_url:
        sync = state.sync = ModelSync(coordination_client(state.redis_url), state.predictor)
        tasks.append(asyncio.ensure_future(sync.run()))
    if state.redis_url and os.environ.get("TOKENGATE_SHARE_PREFIX_HINTS", "1") != "0":
        # (=0 only to measure what sharing is worth: bench_routing --no-share)
        share = state.share = PrefixShare(
            coordination_client(state.redis_url),
            coordination_client(state.redis_url, connections=1, timeout_s=2.0),
            state.fleet.approx)
        tasks.append(asyncio.ensure_future(share.run()))
    counters = None
    if state.redis_url:  # fair-share counters and spend totals, shared by the replicas
        counters = state.flow_share = CounterShare(coordination_client(state.redis_url),
                                                   state.flow)
        tasks.append(asyncio.ensure_future(counters.run()))
        state.spend.redis = coordination_client(state.redis_url)
        tasks.append(asyncio.ensure_future(state.spend.run()))
    sink = rebuild = None
    spend_cfg = state.view.policy.settings.spend
    pg = spend_cfg.database
    if spend_cfg.postgres_url_env and not pg:
        log.error("settings.spend.postgres_url_env names %s, which is not set: spend records "
                  "are not written to PostgreSQL", spend_cfg.postgres_url_env)
    if pg:
        spool = state.view.policy.settings.spend.spool_dir
        sink = PostgresSink(pg, spool_dir=Path(spool) if spool else None)
        state.spend.sinks.append(sink)
        tasks.append(asyncio.ensure_future(sink.run()))
        # calendar budgets lifted to what the ledger says was spent (a Redis restart)
        rebuild = BudgetRebuild(pg, lambda: state.view.policy, state.store,
                                coordination_client(state.redis_url)
                                if state.redis_url else None)
        tasks.append(asyncio.ensure_future(rebuild.run()))
    for name, scaler in state.scalers.items():
        scaler.on_drain = state.live.migrate_from
        tasks.append(asyncio.ensure_future(scaler.run(
            lambda n=name: state.view.pools.get(n))))  # type: ignore[misc]
    tasks.append(asyncio.ensure_future(state.predictor.run(
        publish=sync.publish if sync else None,
        may_train=(lambda: sync.leader) if sync else (lambda: True))))
    yield
    if sink is not None:  # within what is left of the drain; the rest is spooled
        left = (state.drain_deadline - time.monotonic()) if state.drain_deadline else 5.0
        await sink.close(max(0.2, min(left, 5.0)))
    for task in tasks:
        task.cancel()
    for task in tasks:
        with contextlib.suppress(asyncio.CancelledError):
            await task
    if sync is not None:
        with contextlib.suppress(Exception):
            await sync.resign()
        await sync.redis.aclose()
    if share is not None:
        await share.writer.aclose()
        await share.reader.aclose()
    if counters is not None:
        await counters.redis.aclose()
    if state.spend.redis is not None:
        with contextlib.suppress(Exception):
            await state.spend.flush()
        await state.spend.redis.aclose()
    for scaler in state.scalers.values():
        await scaler.close()
    await state.fleet.close()
    state.predictor.close()
    if state.background:
        await asyncio.wait(state.background, timeout=5)
    if sink is not None and sink.buffer:  # recorded by settlements that ended since
        sink.spool()
    if rebuild is not None and rebuild.redis is not None:
        await rebuild.redis.aclose()
    await state.upstream.close()
    await state.store.close()
    state.executor.shutdown(wait=False, cancel_futures=True)


async def _server_header(request: web.Request, response: web.StreamResponse) -> None:
    """No ``Server: Python/… aiohttp/…``: what the gateway runs on is nobody's business."""
    response.headers["Server"] = SERVER


def build_app(state: GatewayState, watcher: PolicyWatcher | None = None) -> web.Application:
    app = web.Application(middlewares=[guard, errors],
                          client_max_size=state.view.policy.settings.max_body_bytes)
    app.on_response_prepare.append(_server_header)
    app[GATEWAY] = state
    if watcher is not None:
        app[WATCHER] = watcher
    app.cleanup_ctx.append(_lifecycle)
    r = app.router
    r.add_post("/v1/chat/completions", lambda q: pipeline.handle(q, "chat"))
    r.add_post("/v1/completions", lambda q: pipeline.handle(q, "completion"))
    r.add_post("/v1/responses", lambda q: pipeline.handle(q, "chat", responses=True))
    r.add_post("/v1/embeddings", embeddings.handle)
    r.add_get("/v1/models", models)
    r.add_get("/openapi.json", openapi_json)
    r.add_get("/health", health)
    r.add_get("/ready", ready)
    r.add_get("/metrics", metrics)
    r.add_get("/admin/policy", admin_policy)
    r.add_get("/admin/endpoints", admin_endpoints)
    r.add_get("/admin/limiter", admin_limiter)
    r.add_get("/admin/spend", admin_spend)
    r.add_get("/admin/flow", admin_flow)
    r.add_get("/admin/predictor", admin_predictor)
    r.add_get("/admin/scaling", admin_scaling)
    r.add_post("/admin/drain", admin_drain)
    return app
