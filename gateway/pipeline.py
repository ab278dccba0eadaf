"""One request's path: authenticate → parse → route → count → admit → pick → proxy → settle.

This is the only sequencer; each step lives in its own module. Settlement runs in a background
task started from ``finally``, so a client that disconnects (which cancels this handler) still
has its reservation settled with what was streamed.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from backend.protocol import GenerationRequest, Kind, load_json, validate
from gateway import quota
from gateway.config.policy import Model, Policy, Route
from gateway.endpoints import EndpointPool, EndpointState
from gateway.errors import APIError, bad
from gateway.limiter.store import StoreUnavailable
from gateway.relay import RelayResult, relay_body, relay_stream
from gateway.state import GATEWAY, GatewayState, PolicyView
from gateway.upstream import UpstreamResponse

log = logging.getLogger("tokengate.gateway")
_RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})


def authenticate(request: web.Request, policy: Policy) -> str:
    """The tenant of the request's bearer key (401 otherwise)."""
    auth = request.headers.get("Authorization", "")
    if not auth.startswith("Bearer ") or len(auth) <= 7:
        raise APIError(401, "You didn't provide an API key. Send it as 'Authorization: "
                       "Bearer KEY'.", code="invalid_api_key")
    digest = hashlib.sha256(auth[7:].strip().encode()).hexdigest()
    found = policy.key_index.get(digest)
    if found is None or not any(hmac.compare_digest(digest, k.sha256)
                                for k in policy.tenants[found[0]].keys):
        raise APIError(401, "Incorrect API key provided.", code="invalid_api_key")
    return found[0]


@dataclass(slots=True)
class _Ctx:
    state: GatewayState
    view: PolicyView
    kind: Kind
    tenant: str
    route: Route
    body: dict[str, Any]
    parsed: GenerationRequest
    request_id: str
    received_at: float
    raw: bytes


def _expected_output(g: GenerationRequest, m: Model) -> int:
    return g.max_tokens if g.max_tokens is not None else m.default_max_tokens


async def handle(request: web.Request, kind: Kind) -> web.StreamResponse:
    received = time.perf_counter()
    state = request.app[GATEWAY]
    if state.draining:
        raise APIError(503, "the gateway is shutting down", type="service_unavailable",
                       code="draining", headers={"retry-after": "1"})
    view = state.view
    policy = view.policy
    tenant = authenticate(request, policy)
    raw = await request.read()
    body = load_json(raw)
    g = validate(kind, body)
    messages = body.get("messages")
    if isinstance(messages, list) and len(messages) > policy.settings.max_messages:
        raise bad(f"too many messages: {len(messages)} > {policy.settings.max_messages}",
                  "messages")
    route = policy.route_for(tenant, g.model)
    if route is None:
        raise APIError(404, f"The model `{g.model}` does not exist or you do not have access "
                       "to it.", param="model", code="model_not_found")
    rid = request.headers.get("X-Request-Id") or uuid.uuid4().hex
    ctx = _Ctx(state, view, kind, tenant, route, body, g, rid, received, raw)
    model = policy.models[g.model]
    try:
        adm = await quota.admit(state.store, policy, tenant, route, model,
                                lambda m: _count_prompt(ctx, m),
                                lambda m: _expected_output(g, m))
    except StoreUnavailable:
        state.metrics.series("limiter", "all", "unavailable").inc()
        raise APIError(503, "rate limiting is unavailable", type="service_unavailable",
                       code="limiter_unavailable", headers={"retry-after": "1"}) from None
    if state.store.stats.fallbacks:
        state.metrics.limiter_fallbacks.inc(state.store.stats.fallbacks)
        state.store.stats.fallbacks = 0
    for refused in adm.refused:
        if refused.denied is not None:
            state.metrics.series("limiter", refused.denied.scope.split(":")[0], "denied").inc()
    if not adm.decision.allowed:
        state.metrics.series("requests", route.name, g.model, tenant, "429").inc()
        raise quota.rate_limit_error(adm.decision)
    state.metrics.series("limiter", "all", "admitted").inc()
    if adm.failover_from:
        state.metrics.series("failovers", "quota", adm.failover_from, adm.model.name).inc()
    return await _proxy(request, ctx, adm)


def _upstream_body(ctx: _Ctx, m: Model) -> bytes:
    """The body sent upstream: the client's, with the upstream model name and usage asked for
    on streams. Forwarded byte for byte when nothing needs to change (large agent prompts)."""
    if ctx.body.get("model") == m.upstream_name and (
            not ctx.parsed.stream or ctx.parsed.include_usage):
        return ctx.raw
    body = dict(ctx.body)
    body["model"] = m.upstream_name
    if ctx.parsed.stream:
        opts = dict(body.get("stream_options") or {})
        opts["include_usage"] = True
        body["stream_options"] = opts
    return orjson.dumps(body)


def _headers(ctx: _Ctx, adm: quota.Admission, ep: EndpointState,
             failover: str | None) -> dict[str, str]:
    h = {"x-request-id": ctx.request_id, "x-tokengate-endpoint": ep.url,
         "x-tokengate-model": adm.model.name}
    if failover:
        h["x-tokengate-failover"] = failover
    h.update(quota.ratelimit_headers(adm.decision.states))
    return h


async def _open(state: GatewayState, ctx: _Ctx, m: Model, pool: EndpointPool,
                ) -> tuple[UpstreamResponse, EndpointState] | APIError:
    """Send to the model's endpoints in turn until one answers (or says it is the client's
    fault); returns the last error when none would."""
    tried: list[EndpointState] = []
    payload = _upstream_body(ctx, m)
    s = ctx.view.policy.settings
    last: APIError = APIError(502, f"no endpoint of {m.name} answered", type="server_error",
                              code="upstream_unavailable")
    while (ep := pool.pick(tried)) is not None:
        tried.append(ep)
        headers = {"Content-Type": "application/json", "X-Request-Id": ctx.request_id}
        if ep.api_key:
            headers["Authorization"] = f"Bearer {ep.api_key}"
        path = "/chat/completions" if ctx.kind == "chat" else "/completions"
        try:
            up = await asyncio.wait_for(
                state.upstream.post(ep.url + path, payload, headers,
                                    connect_timeout_s=s.connect_timeout_s),
                s.request_timeout_s)
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            pool.failed(ep)
            state.metrics.series("upstream_errors", ep.url, "connect").inc()
            log.warning("endpoint %s failed: %s", ep.url, exc)
            continue
        if up.status in _RETRY_STATUSES:
            pool.failed(ep)
            state.metrics.series("upstream_errors", ep.url, str(up.status)).inc()
            last = APIError(502 if up.status >= 500 else 429,
                            f"upstream answered {up.status}", type="server_error",
                            code="upstream_error",
                            headers={"retry-after": up.headers.get("retry-after", "1")})
            up.release()
            continue
        return up, ep
    return last


async def _proxy(request: web.Request, ctx: _Ctx, adm: quota.Admission) -> web.StreamResponse:
    state = ctx.state
    policy = ctx.view.policy
    failover = "quota" if adm.failover_from else None
    opened = await _open(state, ctx, adm.model, ctx.view.pools[adm.model.name])
    if isinstance(opened, APIError) and ctx.route.failover:
        # Every endpoint failed before the first byte: try the fallback chain's models.
        for name in adm.model.fallback:
            if name not in ctx.route.models:
                continue
            fb = policy.models[name]
            nxt = await quota.admit(state.store, policy, ctx.tenant, ctx.route, fb,
                                    lambda m: _count_prompt(ctx, m),
                                    lambda m: _expected_output(ctx.parsed, m))
            if not nxt.decision.allowed or nxt.model is not fb:
                await quota.settle(state.store, nxt, output_tokens=0, prompt_tokens=None,
                                   failed_before_first_token=True)
                continue
            attempt = await _open(state, ctx, fb, ctx.view.pools[fb.name])
            if isinstance(attempt, APIError):
                await quota.settle(state.store, nxt, output_tokens=0, prompt_tokens=None,
                                   failed_before_first_token=True)
                continue
            state.metrics.series("failovers", "upstream", adm.model.name, fb.name).inc()
            await quota.settle(state.store, adm, output_tokens=0, prompt_tokens=None,
                               failed_before_first_token=True)
            adm, opened, failover = nxt, attempt, "upstream"
            break
    if isinstance(opened, APIError):
        await quota.settle(state.store, adm, output_tokens=0, prompt_tokens=None,
                           failed_before_first_token=True)
        state.metrics.series("requests", ctx.route.name, adm.model.name, ctx.tenant,
                                      str(opened.status)).inc()
        raise opened
    up, ep = opened
    pool = ctx.view.pools[adm.model.name]
    reserved_out = adm.expected_output
    pool.acquire(ep, adm.prompt_tokens + reserved_out)
    state.metrics.series("in_flight", ep.url).inc()
    state.metrics.overhead.observe(time.perf_counter() - ctx.received_at)
    result = RelayResult(status=up.status)
    try:
        async with asyncio.timeout(policy.settings.request_timeout_s):
            headers = _headers(ctx, adm, ep, failover)
            if ctx.parsed.stream and up.status == 200:
                resp = web.StreamResponse(status=200, headers={
                    **headers, "Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
                await resp.prepare(request)

                async def progress(n: int) -> None:
                    await quota.charge_progress(state.store, adm, n)

                await relay_stream(
                    up, resp, upstream_model=adm.model.upstream_name, served_model=adm.model.name,
                    pass_usage=ctx.parsed.include_usage, on_tokens=progress,
                    every=policy.settings.progressive_charge_tokens,
                    every_s=policy.settings.progressive_charge_ms / 1000.0, into=result)
                if not result.client_gone:
                    await resp.write_eof()
                return resp
            body, result = await relay_body(up, upstream_model=adm.model.upstream_name,
                                            served_model=adm.model.name)
            return web.Response(status=up.status, body=body, headers={
                **headers, "Content-Type": up.headers.get("content-type", "application/json")})
    finally:
        up.release()
        pool.release(ep, adm.prompt_tokens + reserved_out)
        state.metrics.series("in_flight", ep.url).dec()
        if result.broken:
            pool.failed(ep)
        elif result.status == 200:
            pool.succeeded(ep)
        state.spawn(_finish(ctx, adm, result))


async def _count_prompt(ctx: _Ctx, m: Model) -> int:
    counter = ctx.view.counters[m.name]
    g = ctx.parsed
    if g.kind == "chat":
        return await counter.chat(g.messages)
    if g.prompt_ids is not None:
        return len(g.prompt_ids)
    return await counter.text(g.prompt_text or "")


async def _finish(ctx: _Ctx, adm: quota.Admission, r: RelayResult) -> None:
    """Settle quota and record metrics for a proxied request (runs even after a disconnect)."""
    state = ctx.state
    m = adm.model.name
    usage = r.usage or {}
    ok = r.status == 200
    no_output = not ok or (ctx.parsed.stream and r.first_token_at is None and not r.usage)
    prompt = usage.get("prompt_tokens")
    output = usage.get("completion_tokens")
    if output is None:
        output = r.chunks
    try:
        await quota.settle(state.store, adm, output_tokens=int(output),
                           prompt_tokens=int(prompt) if isinstance(prompt, int) else None,
                           failed_before_first_token=no_output)
    except StoreUnavailable:
        log.warning("settlement of %s deferred: the rate store is unreachable", ctx.request_id)
    status = str(r.status) if not r.broken else "broken"
    state.metrics.series("requests", ctx.route.name, m, ctx.tenant, status).inc()
    if ok and not no_output:
        state.metrics.series("prompt_tokens", m, ctx.tenant).inc(
            int(prompt) if isinstance(prompt, int) else adm.prompt_tokens)
        state.metrics.series("completion_tokens", m, ctx.tenant).inc(int(output))
        if ctx.parsed.stream and r.first_token_at is not None:
            state.metrics.series("ttft", m).observe(r.first_token_at - ctx.received_at)
            if r.last_token_at is not None and r.chunks > 1:
                state.metrics.series("tpot", m).observe(
                    (r.last_token_at - r.first_token_at) / (r.chunks - 1))
