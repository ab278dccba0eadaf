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
import math
import time
import uuid
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from backend.protocol import GenerationRequest, Kind, load_json, validate
from gateway import disagg, quota, slo
from gateway.attempt import Failure, Sent, attempt, continue_stream, upstream_failure
from gateway.config.policy import Model, Policy
from gateway.context import RequestContext
from gateway.endpoints import EndpointState
from gateway.errors import APIError, bad
from gateway.finish import finish
from gateway.httpserver import read_body
from gateway.limiter.store import StoreUnavailable
from gateway.migrate import Live
from gateway.relay import RelayResult, relay_body, relay_stream
from gateway.retry import backoff_s
from gateway.routing.router import Decision
from gateway.state import GATEWAY, GatewayState

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
    raw = await read_body(request, policy.settings.client.body_timeout_s)
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
    ctx = RequestContext(state, view, kind, tenant, route, body, g, rid, received, raw)
    ctx.slo = (slo.header(request, "x-slo-ttft-ms", route.slo_ttft_ms),
               slo.header(request, "x-slo-tpot-ms", route.slo_tpot_ms))
    ctx.priority = slo.priority(request, policy.tenants[tenant].priority)
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


def _upstream_body(ctx: RequestContext, m: Model, kv: dict[str, Any] | None = None) -> bytes:
    """The body sent upstream: the client's, with the upstream model name, usage asked for
    on streams, and the prefill's ``kv_transfer_params`` when the prompt was prefilled
    elsewhere. Forwarded byte for byte when nothing needs to change (large agent prompts)."""
    if kv is None and ctx.body.get("model") == m.upstream_name and (
            not ctx.parsed.stream or ctx.parsed.include_usage):
        return ctx.raw
    body = dict(ctx.body)
    body["model"] = m.upstream_name
    if ctx.parsed.stream:
        opts = dict(body.get("stream_options") or {})
        opts["include_usage"] = True
        body["stream_options"] = opts
    if kv is not None:
        body["kv_transfer_params"] = kv
    return orjson.dumps(body)


def _headers(ctx: RequestContext, adm: quota.Admission, sent: Sent, failover: str | None
             ) -> dict[str, str]:
    d = sent.decision
    h = {"x-request-id": ctx.request_id, "x-tokengate-endpoint": d.endpoint.ep.url,
         "x-tokengate-model": adm.model.name}
    if d.prefill is not None and sent.prefill_used:
        h["x-tokengate-prefill-endpoint"] = d.prefill.ep.url
    if math.isfinite(d.predicted_ttft_ms):
        h["x-tokengate-predicted-ttft-ms"] = f"{d.predicted_ttft_ms:.1f}"
    if math.isfinite(d.predicted_tpot_ms):
        h["x-tokengate-predicted-tpot-ms"] = f"{d.predicted_tpot_ms:.2f}"
    if failover:
        h["x-tokengate-failover"] = failover
    h.update(quota.ratelimit_headers(adm.decision.states))
    return h


async def _open(state: GatewayState, ctx: RequestContext, m: Model, prompt_tokens: int,
                reserved: int) -> Sent | APIError:
    """Route, then send to the chosen endpoint, re-deciding without it until one answers (or
    says it is the client's fault), within the retry policy's attempts and budget; returns
    the last error when none would."""
    router = ctx.view.routers[m.name]
    pool = router.pool
    scaler = state.scalers.get(m.name)
    if scaler is not None:
        scaler.admitted(prompt_tokens, reserved)
        if not pool.endpoints and not await scaler.hold(ctx.route.hold_timeout_ms / 1000.0):
            # Held while the pool woke from zero, and it did not wake in time (or the hold
            # queue is full).
            return APIError(503, f"{m.name} is starting; retry shortly",
                            type="service_unavailable", code="cold_start",
                            headers={"retry-after": "2"})
    t0 = time.perf_counter()
    g = ctx.parsed
    info = await router.prepare(
        ctx.view.counters[m.name], messages=g.messages if g.kind == "chat" else None,
        prompt_ids=g.prompt_ids if g.prompt_ids is not None else ctx.text_ids.get(m.name),
        prompt_text=g.prompt_text, salt=g.cache_salt,
        prompt_tokens=prompt_tokens, expected_output=reserved,
        slo_ttft_ms=ctx.slo[0], slo_tpot_ms=ctx.slo[1], priority=ctx.priority)
    first = await slo.decide(state, ctx.route, m, router, info)
    state.metrics.routing_seconds.observe(time.perf_counter() - t0)
    if isinstance(first, APIError):
        return first
    decision: Decision | None = first
    retries = ctx.view.policy.settings.retries
    t = ctx.route.timeouts
    path = "/chat/completions" if ctx.kind == "chat" else "/completions"
    tried: list[EndpointState] = []
    last: APIError = APIError(502, f"no endpoint of {m.name} answered", type="server_error",
                              code="upstream_unavailable")
    pool.budget.deposit()
    pause = False
    while decision is not None:
        if tried:  # a retry: within the attempts and the budget, after a backoff if overload
            if len(tried) >= retries.max_attempts or not pool.budget.withdraw():
                state.metrics.series("retries", m.name, "denied").inc()
                break
            state.metrics.series("retries", m.name, "made").inc()
            if pause:
                await asyncio.sleep(backoff_s(retries, len(tried), state.rng))
        ep = decision.endpoint.ep
        tried.append(ep)
        router.commit(decision, info)
        state.metrics.series("routing_decisions", m.name, router.strategy, ep.url,
                             "decode" if decision.prefill else "sole").inc()
        kv = None
        started_at = time.perf_counter()
        if decision.prefill is not None:
            state.metrics.series("routing_decisions", m.name, router.strategy,
                                 decision.prefill.ep.url, "prefill").inc()
            kv = await disagg.remote_prefill(state, t, ctx.kind, ctx.request_id, ctx.body, m,
                                             pool, decision)
        prefill_tokens = 0 if kv is not None else decision.endpoint.uncached_tokens
        ticket = pool.acquire(ep, info.prompt_tokens + reserved, prefill_tokens)
        sent_at = time.perf_counter()
        try:
            try:
                up, lines = await attempt(state, ctx, pool, ep, ep.url + path,
                                           _upstream_body(ctx, m, kv), t)
            except (aiohttp.ClientError, OSError, TimeoutError) as exc:
                raise upstream_failure(exc, g.stream) from exc
            if up.status in _RETRY_STATUSES:
                asked = up.headers.get("retry-after")
                up.release()
                if asked is not None:
                    pool.overloaded(ep, asked)
                retry_after = asked or "1"
                raise Failure(APIError(502 if up.status >= 500 else 429,
                                        f"upstream answered {up.status}", type="server_error",
                                        code="upstream_error",
                                        headers={"retry-after": retry_after}),
                               str(up.status), True)
        except Failure as f:
            pool.release(ticket)
            pool.failed(ep, transport=f.kind in ("connect", "broken"))
            if f.kind in ("connect", "broken", "timeout"):
                state.fleet.suspect(ep)
            state.metrics.series("upstream_errors", ep.url, f.kind).inc()
            log.warning("endpoint %s failed (%s); retrying elsewhere if allowed", ep.url,
                        f.kind)
            last, pause = f.error, f.backoff
            if f.kind == "timeout" and not g.stream:
                break  # a whole non-streamed request timed out: do not run it again
            decision = router.decide(info, tried)
            continue
        except BaseException:  # cancelled (the client left): give the counters back
            pool.release(ticket)
            raise
        state.metrics.series("prefix_cached_tokens", m.name).inc(
            decision.endpoint.cached_tokens if kv is None else info.prompt_tokens)
        return Sent(up, decision, pool, ticket, sent_at, kv is not None, lines, info,
                    started_at if kv is not None else None)
    return last


async def _proxy(request: web.Request, ctx: RequestContext, adm: quota.Admission
                 ) -> web.StreamResponse:
    state = ctx.state
    policy = ctx.view.policy
    failover = "quota" if adm.failover_from else None
    opened = await _open(state, ctx, adm.model, adm.prompt_tokens, adm.expected_output)
    if (isinstance(opened, APIError) and ctx.route.failover
            and opened.code not in ("overloaded",)):
        # Every endpoint failed before the first byte (or none can meet the SLO): try the
        # fallback chain's models.
        reason = "slo" if opened.code == "slo_unattainable" else "upstream"
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
            attempt = await _open(state, ctx, fb, nxt.prompt_tokens, nxt.expected_output)
            if isinstance(attempt, APIError):
                await quota.settle(state.store, nxt, output_tokens=0, prompt_tokens=None,
                                   failed_before_first_token=True)
                continue
            state.metrics.series("failovers", reason, adm.model.name, fb.name).inc()
            await quota.settle(state.store, adm, output_tokens=0, prompt_tokens=None,
                               failed_before_first_token=True)
            adm, opened, failover = nxt, attempt, reason
            break
    if isinstance(opened, APIError):
        await quota.settle(state.store, adm, output_tokens=0, prompt_tokens=None,
                           failed_before_first_token=True)
        state.metrics.series("requests", ctx.route.name, adm.model.name, ctx.tenant,
                                      str(opened.status)).inc()
        raise opened
    sent = opened
    up, ep, pool = sent.up, sent.decision.endpoint.ep, sent.pool
    state.metrics.series("in_flight", ep.url).inc()
    state.metrics.overhead.observe(sent.sent_at - ctx.received_at)
    result = RelayResult(status=up.status)

    def first_token() -> None:
        pool.first_token(sent.ticket)

    t = ctx.route.timeouts
    try:
        headers = _headers(ctx, adm, sent, failover)
        if sent.lines is not None:
            resp = web.StreamResponse(status=200, headers={
                **headers, "Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
            await resp.prepare(request)

            async def progress(n: int) -> None:
                await quota.charge_progress(state.store, adm, n)

            shift = 0
            while True:
                # Streams of pools that scale may be moved off a draining endpoint.
                live = (Live(ep.url, sent.up.abort) if adm.model.scaling is not None
                        else None)
                if live is not None:
                    state.live.add(live)
                try:
                    await relay_stream(
                        sent.lines, resp, upstream_model=adm.model.upstream_name,
                        served_model=adm.model.name, pass_usage=ctx.parsed.include_usage,
                        on_tokens=progress, every=policy.settings.progressive_charge_tokens,
                        every_s=policy.settings.progressive_charge_ms / 1000.0, into=result,
                        on_first=first_token, gap_s=t.between_tokens_s,
                        deadline_s=t.total_s - (time.perf_counter() - sent.sent_at),
                        live=live, usage_shift=shift, tally=ep)
                finally:
                    if live is not None:
                        state.live.remove(live)
                if not result.migrated or live is None:
                    break
                moved = await continue_stream(state, ctx, adm, sent, live,
                                              result.chunks)
                if moved is None:
                    result.broken = True
                    await resp.write(b'data: {"error": {"message": "the stream could not be '
                                     b'moved to another endpoint", "type": "server_error", '
                                     b'"param": null, "code": "migration_failed"}}\n\n'
                                     b"data: [DONE]\n\n")
                    break
                # Hand over: the old endpoint's share goes back, the new one's is taken.
                up.release()
                pool.release(sent.ticket)
                state.metrics.series("in_flight", ep.url).dec()
                sent, shift = moved, result.chunks
                up, ep, pool = sent.up, sent.decision.endpoint.ep, sent.pool
                state.metrics.series("in_flight", ep.url).inc()
                result.migrated = False
            if not result.client_gone:
                await resp.write_eof()
            return resp
        try:
            async with asyncio.timeout(max(t.total_s - (time.perf_counter() - sent.sent_at),
                                           0.001)):
                body, result = await relay_body(up, upstream_model=adm.model.upstream_name,
                                                served_model=adm.model.name)
        except (TimeoutError, OSError, aiohttp.ClientError) as exc:
            err = upstream_failure(exc, False).error
            result.broken, result.status = True, err.status
            raise err from None
        return web.Response(status=up.status, body=body, headers={
            **headers, "Content-Type": up.headers.get("content-type", "application/json")})
    finally:
        up.release()
        pool.release(sent.ticket)
        state.metrics.series("in_flight", ep.url).dec()
        if result.broken:
            pool.failed(ep, transport=True)
            state.fleet.suspect(ep)
        elif result.status == 200:
            pool.succeeded(ep)
        state.spawn(finish(ctx, adm, result, sent))


async def _count_prompt(ctx: RequestContext, m: Model) -> int:
    counter = ctx.view.counters[m.name]
    g = ctx.parsed
    if g.kind == "chat":
        return await counter.chat(g.messages)
    if g.prompt_ids is not None:
        return len(g.prompt_ids)
    ids = await counter.text_ids(g.prompt_text or "")
    ctx.text_ids[m.name] = ids  # routing hashes the same ids: tokenize once
    return len(ids)
