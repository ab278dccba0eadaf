"""The gateway's HTTP application: its routes (the admin ones in ``admin``), lifecycle. Wiring
only."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path

import orjson
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from gateway.flow.share import CounterShare
from gateway.front import openapi
from gateway.front.admin import ROUTES as ADMIN_ROUTES
from gateway.front.admin import WATCHER, admin, json_text
from gateway.front.http_guard import SERVER, guard
from gateway.front.reload import PolicyWatcher
from gateway.quota.limiter.census import Census
from gateway.quota.limiter.resilient import ResilientStore
from gateway.redis_clients import coordination_client
from gateway.request import embeddings, pipeline
from gateway.routing.prefix_hints import PrefixShare
from gateway.spend.postgres import PostgresSink
from gateway.spend.rebuild import BudgetRebuild
from gateway.state import GATEWAY, GatewayState
from predictor.sync import ModelSync
from protocol.errors import errors

log = logging.getLogger("tokengate.gateway")

async def models(request: web.Request) -> web.Response:
    state = request.app[GATEWAY]
    policy = state.view.policy
    tenant = pipeline.authenticate(request.headers, policy)
    data = [{"id": m, "object": "model", "created": 0, "owned_by": "tokengate"}
            for m in policy.models_for(tenant)]
    return web.json_response({"object": "list", "data": data}, dumps=json_text)


async def openapi_json(request: web.Request) -> web.Response:
    limit = request.app[GATEWAY].view.policy.settings.max_messages
    return web.Response(body=_openapi(limit), content_type="application/json")


@functools.cache
def _openapi(max_messages: int) -> bytes:
    return orjson.dumps(openapi.document(max_messages))


async def health(request: web.Request) -> web.Response:
    return web.Response(text="ok")


async def ready(request: web.Request) -> web.Response:
    status, text = request.app[GATEWAY].readiness()
    return web.Response(status=status, text=text)


async def metrics(request: web.Request) -> web.Response:
    state = request.app[GATEWAY]
    if not state.view.policy.settings.public_metrics and state.view.admin_digest is not None:
        admin(request)
    # Models trained since the last scrape (the predictor counts; the counter follows).
    trained = state.predictor.trainings - state.metrics.trainings_seen
    if trained > 0:
        state.metrics.predictor_trainings.inc(trained)
        state.metrics.trainings_seen = state.predictor.trainings
    body = generate_latest(state.metrics.registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


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
    census = None
    if state.redis_url and isinstance(state.store, ResilientStore):
        census = Census(coordination_client(state.redis_url, connections=1),
                        state.store.counted)
        tasks.append(asyncio.ensure_future(census.run()))
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
    if census is not None:
        await census.leave()
        await census.redis.aclose()
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
    for method, path, handler, _ in ADMIN_ROUTES:
        r.add_route(method, path, handler)
    return app
