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
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from backend.protocol import GenerationRequest, Kind, load_json, validate
from gateway import disagg, migrate, quota, slo
from gateway.config.policy import Model, Policy, Route
from gateway.config.resilience import Timeouts
from gateway.endpoints import EndpointPool, EndpointState, Ticket
from gateway.errors import APIError, bad
from gateway.httpserver import read_body
from gateway.limiter.store import StoreUnavailable
from gateway.migrate import Live
from gateway.relay import RelayResult, relay_body, relay_stream
from gateway.retry import backoff_s
from gateway.routing.plugins import RequestInfo
from gateway.routing.router import Decision
from gateway.state import GATEWAY, GatewayState, PolicyView
from gateway.upstream import UpstreamBroken, UpstreamResponse

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
    slo: tuple[float | None, float | None] = (None, None)
    priority: str = "standard"
    text_ids: dict[str, list[int]] = field(default_factory=dict)  # model -> prompt ids


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
    ctx = _Ctx(state, view, kind, tenant, route, body, g, rid, received, raw)
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


# TPOT is learned and scored only over streams of at least this many tokens: over one or two
# gaps it is a single step's time, decided by whether a prefill chunk shared that step, which
# no feature of the endpoint can tell in advance.
_TPOT_MIN_TOKENS = 8


def _upstream_body(ctx: _Ctx, m: Model, kv: dict[str, Any] | None = None) -> bytes:
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


@dataclass(slots=True)
class _Sent:
    """An upstream response being relayed, and what routing decided and promised for it."""

    up: UpstreamResponse
    decision: Decision
    pool: EndpointPool
    ticket: Ticket  # this request's share of the endpoint's live counters
    sent_at: float
    prefill_used: bool = False
    lines: AsyncIterator[bytes] | None = None  # a stream's events, the first already read
    info: RequestInfo | None = None  # what routing knew of the request (to re-route it)


def _headers(ctx: _Ctx, adm: quota.Admission, sent: _Sent, failover: str | None
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


async def _attempt(state: GatewayState, ctx: _Ctx, pool: EndpointPool, ep: EndpointState,
                   url: str, body: bytes, t: Timeouts
                   ) -> tuple[UpstreamResponse, AsyncIterator[bytes] | None]:
    """Send one attempt; for a stream, also wait for its first event (within
    ``first_token_s``), so that an upstream that stalls or breaks before producing anything
    can still be retried elsewhere, invisibly to the client."""
    headers = {"Content-Type": "application/json", "X-Request-Id": ctx.request_id,
               **pool.auth_headers(ep)}
    if not ctx.parsed.stream:
        up = await asyncio.wait_for(
            state.upstream.post(url, body, headers, connect_timeout_s=t.connect_s), t.total_s)
        return up, None
    async with asyncio.timeout(t.first_token_s):
        up = await state.upstream.post(url, body, headers, connect_timeout_s=t.connect_s)
        if up.status != 200:
            return up, None
        lines = up.lines()
        try:
            first = await anext(lines)
        except StopAsyncIteration:
            up.release()
            raise UpstreamBroken("the upstream ended the stream before any event") from None
        except BaseException:
            up.release()
            raise
    return up, _prepend(first, lines)


async def _prepend(first: bytes, rest: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    yield first
    async for line in rest:
        yield line


class _Failure(Exception):
    """One attempt failed in a way another endpoint may not: retry (``backoff`` says whether
    to pause first: overload answers and stalls, not refused connections)."""

    def __init__(self, error: APIError, kind: str, backoff: bool) -> None:
        super().__init__(error.message)
        self.error, self.kind, self.backoff = error, kind, backoff


def _upstream_failure(exc: BaseException, stream: bool) -> _Failure:
    if isinstance(exc, TimeoutError):
        what = "first token" if stream else "response"
        return _Failure(APIError(504, f"the upstream did not send its {what} in time",
                                 type="server_error", code="upstream_timeout"), "timeout", True)
    refused = isinstance(exc, ConnectionRefusedError)
    return _Failure(APIError(502, "the upstream could not be reached" if refused else
                             "the upstream closed the connection", type="server_error",
                             code="upstream_unavailable"),
                    "connect" if refused else "broken", not refused)


async def _open(state: GatewayState, ctx: _Ctx, m: Model, prompt_tokens: int, reserved: int
                ) -> _Sent | APIError:
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
                up, lines = await _attempt(state, ctx, pool, ep, ep.url + path,
                                           _upstream_body(ctx, m, kv), t)
            except (aiohttp.ClientError, OSError, TimeoutError) as exc:
                raise _upstream_failure(exc, g.stream) from exc
            if up.status in _RETRY_STATUSES:
                asked = up.headers.get("retry-after")
                up.release()
                if asked is not None:
                    pool.overloaded(ep, asked)
                retry_after = asked or "1"
                raise _Failure(APIError(502 if up.status >= 500 else 429,
                                        f"upstream answered {up.status}", type="server_error",
                                        code="upstream_error",
                                        headers={"retry-after": retry_after}),
                               str(up.status), True)
        except _Failure as f:
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
        return _Sent(up, decision, pool, ticket, sent_at, kv is not None, lines, info)
    return last


async def _proxy(request: web.Request, ctx: _Ctx, adm: quota.Admission) -> web.StreamResponse:
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
                        live=live, usage_shift=shift)
                finally:
                    if live is not None:
                        state.live.remove(live)
                if not result.migrated or live is None:
                    break
                moved = await _continue(state, ctx, adm, sent, live, result.chunks)
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
            err = _upstream_failure(exc, False).error
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
        state.spawn(_finish(ctx, adm, result, sent))


async def _continue(state: GatewayState, ctx: _Ctx, adm: quota.Admission, sent: _Sent,
                    live: Live, generated: int) -> _Sent | None:
    """Continue a stream cut off a draining endpoint on another one (``gateway.migrate``)."""
    m = adm.model
    router = ctx.view.routers[m.name]
    pool = router.pool
    old = sent.decision.endpoint.ep
    counter = ctx.view.counters[m.name]
    body = migrate.continuation(ctx.body, ctx.kind, migrate.generated_text(
        live.payloads, ctx.kind), generated, counter.tokenizer.encode)
    body["model"] = m.upstream_name
    body["stream_options"] = {"include_usage": True}
    raw = orjson.dumps(body)
    path = "/chat/completions" if ctx.kind == "chat" else "/completions"
    info = sent.info
    tried = [old]
    decision = router.decide(info, tried) if info is not None else None
    while decision is not None and len(tried) <= ctx.view.policy.settings.retries.max_attempts:
        ep = decision.endpoint.ep
        tried.append(ep)
        tokens = (info.prompt_tokens if info else 0) + adm.expected_output
        ticket = pool.acquire(ep, tokens, tokens - adm.expected_output + generated)
        try:
            up, lines = await _attempt(state, ctx, pool, ep, ep.url + path, raw,
                                       ctx.route.timeouts)
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            pool.release(ticket)
            log.warning("migration of %s to %s failed: %s", ctx.request_id, ep.url, exc)
            decision = router.decide(info, tried) if info is not None else None
            continue
        except BaseException:
            pool.release(ticket)
            raise
        if up.status != 200 or lines is None:
            up.release()
            pool.release(ticket)
            decision = router.decide(info, tried) if info is not None else None
            continue
        pool.first_token(ticket)  # _attempt waited for its first event: the prompt is in
        state.metrics.series("migrations", m.name, "moved").inc()
        log.info("moved stream %s from %s to %s after %d tokens", ctx.request_id, old.url,
                 ep.url, generated)
        return _Sent(up, decision, pool, ticket, time.perf_counter(), False, lines, info)
    state.metrics.series("migrations", m.name, "failed").inc()
    return None


async def _count_prompt(ctx: _Ctx, m: Model) -> int:
    counter = ctx.view.counters[m.name]
    g = ctx.parsed
    if g.kind == "chat":
        return await counter.chat(g.messages)
    if g.prompt_ids is not None:
        return len(g.prompt_ids)
    ids = await counter.text_ids(g.prompt_text or "")
    ctx.text_ids[m.name] = ids  # routing hashes the same ids: tokenize once
    return len(ids)


def _observe(ctx: _Ctx, r: RelayResult, sent: _Sent) -> None:
    """Feed the predictor what this request saw, against the features it was routed on."""
    if not ctx.parsed.stream or r.first_token_at is None or r.broken:
        return
    state, d = ctx.state, sent.decision
    ttft_ms = (r.first_token_at - sent.sent_at) * 1000.0
    tpot_ms = ((r.last_token_at - r.first_token_at) * 1000.0 / (r.chunks - 1)
               if r.last_token_at is not None and r.chunks >= _TPOT_MIN_TOKENS else None)
    lead = d.prefill if (d.prefill is not None and sent.prefill_used) else d.endpoint
    lead.ep.observed(ttft_ms, None)
    d.endpoint.ep.observed(None, tpot_ms)
    if lead.row is not None:
        state.predictor.observe(lead.row, ttft_ms=ttft_ms, tpot_ms=None,
                                predicted_ttft_ms=lead.ttft_ms)
        if state.sync is not None:
            state.sync.queue_sample("ttft", lead.row, math.log(max(ttft_ms, 1e-3)))
    if d.endpoint.row is not None and tpot_ms is not None:
        state.predictor.observe(d.endpoint.row, ttft_ms=None, tpot_ms=tpot_ms,
                                predicted_tpot_ms=d.endpoint.tpot_ms)
        if state.sync is not None:
            state.sync.queue_sample("tpot", d.endpoint.row, math.log(max(tpot_ms, 1e-3)))


async def _finish(ctx: _Ctx, adm: quota.Admission, r: RelayResult, sent: _Sent) -> None:
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
        _observe(ctx, r, sent)
        state.metrics.series("prompt_tokens", m, ctx.tenant).inc(
            int(prompt) if isinstance(prompt, int) else adm.prompt_tokens)
        state.metrics.series("completion_tokens", m, ctx.tenant).inc(int(output))
        if ctx.parsed.stream and r.first_token_at is not None:
            state.metrics.series("ttft", m).observe(r.first_token_at - ctx.received_at)
            if r.last_token_at is not None and r.chunks > 1:
                state.metrics.series("tpot", m).observe(
                    (r.last_token_at - r.first_token_at) / (r.chunks - 1))
