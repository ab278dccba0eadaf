"""Getting a request to an endpoint that answers: hold while a pool wakes from zero, route,
send, and re-decide without a failed endpoint under the one retry policy
(``gateway.routing.retry.Retrier``); with a remote prefill first when routing picked one
(``gateway.request.disagg``). Walks the model's fallback chain when every endpoint failed before the
first byte (or none can meet the SLO). Returns a ``Sent`` or the error to answer.

Every reservation this module makes (a fallback's) is recorded in ``ctx.admissions``, so the
pipeline settles it whatever happens after, cancellation included."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar
from urllib.parse import urlsplit

import orjson
from opentelemetry.trace import Span, SpanKind

from gateway import clock
from gateway.config.flow import FlowControl
from gateway.config.policy import Model
from gateway.flow.control import ModelGate, Pass
from gateway.flow.waiter import engine_priority
from gateway.quota import ledger as quota
from gateway.request import admission, disagg, slo
from gateway.request.attempt import Attempt, Sent, attempt_on, retry
from gateway.request.context import RequestContext
from gateway.request.failure import Failure
from gateway.request.fields import GATEWAY_ONLY_FIELDS
from gateway.request.settle import refund_later
from gateway.routing.endpoints import EndpointPool, EndpointState
from gateway.routing.plugins import RequestInfo
from gateway.routing.router import Decision, Router
from gateway.state import GatewayState
from gateway.tracing import candidates_attrs
from protocol.errors import APIError

log = logging.getLogger("tokengate.gateway")
T = TypeVar("T")

SPILL = "pool_saturated"  # route()'s answer when a request goes to the spillover model


def band_of(ctx: RequestContext) -> str:
    """The band it waits in: within its reserved throughput a standard request waits in the
    band above standard."""
    return "reserved" if ctx.tier == "reserved" and ctx.priority == "standard" \
        else ctx.priority


def engine_fields(ctx: RequestContext, m: Model) -> dict[str, Any]:
    """``priority`` for the engine's queue when ``flow_control.engine_priority`` is on: the
    flow gate's (``fair.engine_priority``), or the band's when the request did not queue."""
    if not ctx.view.policy.settings.flow_control.engine_priority:
        return {}
    turn = ctx.flow_passes.get(m.name)
    return {"priority": turn.engine_priority if turn is not None
            else engine_priority(band_of(ctx), False)}


# What a body that asked for no stream gains at its end (``upstream_body``).
STREAM_WITH_USAGE = b',"stream":true,"stream_options":{"include_usage":true}}'


def client_fields(ctx: RequestContext) -> dict[str, Any]:
    """The client's body without the fields only the gateway sets."""
    return {k: v for k, v in ctx.body.items() if k not in GATEWAY_ONLY_FIELDS}


def _as_sent(ctx: RequestContext, m: Model) -> bool:
    """The client's body already names ``m``'s upstream model and holds no field only the
    gateway sets: its bytes can go upstream as they came (inputs of megabytes are not
    encoded again)."""
    return ctx.body.get("model") == m.upstream_name and not any(
        f in ctx.body for f in GATEWAY_ONLY_FIELDS)


def embeddings_body(ctx: RequestContext, m: Model) -> bytes:
    """An embeddings request as sent upstream: the client's fields with the upstream model
    name; the client's bytes when that changes nothing."""
    if _as_sent(ctx, m):
        return ctx.raw
    return orjson.dumps({**client_fields(ctx), "model": m.upstream_name})


def upstream_body(ctx: RequestContext, m: Model, kv: dict[str, Any] | None = None) -> bytes:
    """The body sent upstream: the client's, with the upstream model name, the reserved
    ``max_tokens`` when the client gave none, a stream with usage asked for (always: a client
    that did not ask for a stream gets the answer ``gateway.request.aggregate`` builds from it, so
    every token is seen as it is made), and the prefill's ``kv_transfer_params`` when the
    prompt was prefilled elsewhere. Forwarded byte for byte when nothing needs to change
    (large agent prompts)."""
    limit = ctx.output_limit.get(m.name) if ctx.parsed.max_tokens is None else None
    extra = engine_fields(ctx, m)
    if kv is None and limit is None and not extra and _as_sent(ctx, m):
        if ctx.parsed.stream and ctx.parsed.include_usage:
            return ctx.raw
        if "stream" not in ctx.body and "stream_options" not in ctx.body:
            # The client's bytes with the stream asked for after its last field: no key is
            # repeated.
            end = ctx.raw.rstrip()
            if end.endswith(b"}"):
                return end[:-1] + STREAM_WITH_USAGE
    body = client_fields(ctx)
    body.update(extra)
    body["model"] = m.upstream_name
    if limit is not None:
        body["max_tokens"] = limit  # what was reserved: the engine stops there
    body["stream"] = True
    opts = dict(body.get("stream_options") or {})
    opts["include_usage"] = True
    body["stream_options"] = opts
    if kv is not None:
        body["kv_transfer_params"] = kv
    return orjson.dumps(body)


async def route(state: GatewayState, ctx: RequestContext, m: Model, prompt_tokens: int,
                reserved: int, exclude: Callable[[EndpointPool], Sequence[EndpointState]]
                | None = None) -> tuple[Router, RequestInfo, Decision] | APIError:
    """Hold while the pool wakes from zero, then the first decision (held to the SLO),
    never on an endpoint ``exclude`` names (an EPP's proxy may narrow the candidates)."""
    router = ctx.view.routers[m.name]
    if spills(state, ctx, m):
        return APIError(503, f"{m.name}'s pool is saturated", type="service_unavailable",
                        code=SPILL)
    scaler = state.scalers.get(m.name)
    if scaler is not None:
        scaler.admitted(prompt_tokens, reserved)
        if not router.pool.endpoints and not await scaler.hold(
                ctx.route.hold_timeout_ms / 1000.0):
            # Held while the pool woke from zero, and it did not wake in time (or the hold
            # queue is full).
            return APIError(503, f"{m.name} is starting; retry shortly",
                            type="service_unavailable", code="cold_start",
                            headers={"retry-after": "2"})
    t0 = time.perf_counter()
    g = ctx.parsed
    info = await router.prepare(
        ctx.view.counters[m.name], chat=ctx.chat_prompts.get(m.name),
        prompt_ids=g.prompt_ids if g.prompt_ids is not None else ctx.text_ids.get(m.name),
        prompt_text=g.prompt_text, salt=g.cache_salt,
        prompt_tokens=prompt_tokens, expected_output=reserved,
        slo_ttft_ms=ctx.slo[0], slo_tpot_ms=ctx.slo[1], priority=ctx.priority,
        slots=state.counting, tenant=ctx.tenant)
    turn = await flow_turn(state, ctx, m, info.prompt_tokens, reserved)
    try:
        first = await slo.decide(state, ctx.route, m, router, info,
                                 exclude(router.pool) if exclude is not None else ())
    finally:
        if turn is not None:
            turn.sent()
    state.metrics.routing_seconds.observe(time.perf_counter() - t0)
    if isinstance(first, APIError):
        return first
    return router, info, first


def spills(state: GatewayState, ctx: RequestContext, m: Model) -> bool:
    """Does this pay-as-you-go request go to ``m``'s spillover model instead of waiting for
    ``m``'s saturated pool? Reserved and flex requests never spill, nor one whose spillover
    already failed."""
    if m.spillover is None or ctx.tier != "payg" or ctx.no_spill \
            or m.spillover not in ctx.route.models:
        return False
    cfg = ctx.view.policy.settings.flow_control
    if not state.flow.queues(cfg):
        return False
    return flow_gate(state, m, cfg).gate.saturated(clock.now())


def flow_gate(state: GatewayState, m: Model, cfg: FlowControl) -> ModelGate:
    name = m.name

    def endpoints() -> Sequence[EndpointState]:
        pool = state.view.pools.get(name)
        return pool.endpoints if pool is not None else ()

    return state.flow.get(name, cfg, endpoints)


async def flow_turn(state: GatewayState, ctx: RequestContext, m: Model, prompt_tokens: int,
                    reserved: int) -> Pass | None:
    """Wait for the request's turn on ``m`` when the pool is saturated (flow control; None
    when the policy and ``--flow-control`` leave it off)."""
    cfg = ctx.view.policy.settings.flow_control
    if not state.flow.queues(cfg):
        return None
    name = m.name
    gate = flow_gate(state, m, cfg)
    deadline = cfg.deadline(ctx.received_at, ctx.slo[0])
    turn = await gate.enter(ctx.flow, band_of(ctx), deadline, prompt_tokens, reserved,
                            ctx.view.policy.tenants[ctx.tenant].weight)
    old = ctx.flow_passes.pop(name, None)
    if old is not None:  # tried on this model before: that turn served nothing
        old.settled(0, 0)
    ctx.flow_passes[name] = turn
    return turn


async def open_model(state: GatewayState, ctx: RequestContext, m: Model, prompt_tokens: int,
                     reserved: int) -> Sent | APIError:
    """Route, then send to the chosen endpoint, re-deciding without it until one answers (or
    says it is the client's fault), within the retry policy; the last error when none
    would."""
    routed = await traced_route(state, ctx, m, prompt_tokens, reserved)
    if isinstance(routed, APIError):
        return routed
    router, info, first = routed
    pool = router.pool

    async def try_one(decision: Decision, n: int) -> Sent:
        ep = decision.endpoint.ep
        state.metrics.series("routing_decisions", m.name, router.strategy, ep.url,
                             "decode" if decision.prefill else "sole").inc()
        started_at = time.perf_counter()
        await load_adapter(state, ctx, m, pool, ep)
        kv = await prefill(state, ctx, m, router, decision)
        a = Attempt(state, ctx, pool, ep, info.prompt_tokens + reserved,
                    0 if kv is not None else decision.endpoint.uncached_tokens,
                    upstream_span(ctx, m, ep.url, kv is not None, n))
        if kv is None and math.isfinite(decision.predicted_ttft_ms):
            # (a decode after a remote prefill waits for the KV transfer too, which nothing
            # predicts, NIXL's first handshake above all: it waits the route's first_token_s)
            a.predicted_ttft_s = decision.predicted_ttft_ms / 1e3
        sent_at = time.perf_counter()
        ans = await attempt_on(state, ctx, a, upstream_body(ctx, m, kv))
        router.commit(decision, info)  # only now are its blocks on that engine
        state.metrics.series("prefix_cached_tokens", m.name).inc(
            decision.endpoint.cached_tokens if kv is None else info.prompt_tokens)
        return Sent(ans.up, decision, a, sent_at, kv is not None, ans.lines, info,
                    started_at if kv is not None else None)

    return await retry(state, ctx, router, info, first, [], try_one,
                       APIError(502, f"no endpoint of {m.name} answered", type="server_error",
                                code="upstream_unavailable"), m.name)


async def load_adapter(state: GatewayState, ctx: RequestContext, m: Model,
                       pool: EndpointPool, ep: EndpointState) -> None:
    """A LoRA adapter is loaded on ``ep`` before the request goes there (waiting at most the
    route's first-token timeout), and held there until the request ends; a load the engine
    refuses fails the request (502 naming the adapter), not the endpoint."""
    if m.lora is None:
        return
    limits = [x.lora.max_loaded for x in state.view.policy.models.values()
              if x.lora is not None and x.lora.max_loaded is not None
              and any(e.url == ep.url for e in x.endpoints)]
    loader = state.fleet.adapters
    try:
        held = await loader.ensure(m, ep, pool.auth_headers(ep),
                                   min(limits) if limits else None,
                                   ctx.route.timeouts.first_token_s)
    except APIError as exc:
        raise Failure(exc, "adapter", False, endpoint_fault=False) from None
    if held:
        ctx.on_end.append(lambda: loader.release(ep.url, m.upstream_name))


async def traced_route(state: GatewayState, ctx: RequestContext, m: Model, prompt_tokens: int,
                       reserved: int, exclude: Callable[[EndpointPool], Sequence[EndpointState]]
                       | None = None) -> tuple[Router, RequestInfo, Decision] | APIError:
    """``route``, inside the request's ``tokengate.route`` span."""
    span = ctx.trace.child("tokengate.route", {"tokengate.model": m.name}) \
        if ctx.trace is not None else None
    routed = await route(state, ctx, m, prompt_tokens, reserved, exclude)
    if ctx.trace is not None:
        if isinstance(routed, APIError):
            ctx.trace.end(span, {"error.type": routed.code}, error=routed.message)
        else:
            ctx.trace.end(span, _decision_attrs(routed[0], routed[2], routed[1]))
    return routed


async def prefill(state: GatewayState, ctx: RequestContext, m: Model, router: Router,
                  decision: Decision) -> dict[str, Any] | None:
    """The remote prefill when routing picked a prefill endpoint (counted, in its span): the
    ``kv_transfer_params`` for decode, or None (decode computes the prompt itself)."""
    if decision.prefill is None:
        return None
    state.metrics.series("routing_decisions", m.name, router.strategy,
                         decision.prefill.ep.url, "prefill").inc()
    pspan = ctx.trace.child("tokengate.prefill", _server_attrs(
        decision.prefill.ep.url, m), kind=SpanKind.CLIENT) if ctx.trace else None
    kv = await disagg.remote_prefill(
        state, ctx.route.timeouts, ctx.kind, ctx.request_id,
        {**client_fields(ctx), **engine_fields(ctx, m)}, m, router.pool,
        decision, ctx.trace.headers(pspan) if ctx.trace and pspan else None)
    if ctx.trace is not None:
        ctx.trace.end(pspan, {"tokengate.prefill.ok": kv is not None},
                      error=None if kv is not None else "prefill failed: decode alone")
    return kv


def upstream_span(ctx: RequestContext, m: Model, url: str, prefilled: bool, n: int
                  ) -> Span | None:
    """The span of the call to the engine (its ``Attempt`` ends it); its context goes to the
    engine in the request's headers, so the engine's spans join the trace."""
    if ctx.trace is None:
        return None
    return ctx.trace.child(
        f"{'chat' if ctx.kind == 'chat' else 'text_completion'} {m.upstream_name}",
        {**_server_attrs(url, m), "tokengate.phase": "decode" if prefilled
         else "prefill+decode", "tokengate.attempt": n}, kind=SpanKind.CLIENT)


def _server_attrs(url: str, m: Model) -> dict[str, Any]:
    u = urlsplit(url)
    return {"server.address": u.hostname, "server.port": u.port, "url.full": url,
            "gen_ai.request.model": m.upstream_name}


def _decision_attrs(router: Router, d: Decision, info: RequestInfo) -> dict[str, Any]:
    cands = d.considered or (d.endpoint,)
    return {"tokengate.routing.strategy": router.strategy,
            "tokengate.routing.endpoint": d.endpoint.ep.url,
            "tokengate.routing.prefill_endpoint": d.prefill.ep.url if d.prefill else None,
            "tokengate.prompt_blocks": len(info.hashes),
            **candidates_attrs([c.ep.url for c in cands], [c.cached_tokens for c in cands],
                               [None if math.isnan(c.ttft_ms) else c.ttft_ms for c in cands],
                               [None if math.isnan(c.tpot_ms) else c.tpot_ms for c in cands])}


Opener = Callable[[GatewayState, RequestContext, Model, int, int], Awaitable[T | APIError]]


async def open_request(state: GatewayState, ctx: RequestContext, adm: quota.Admission,
                       opener: Opener[T]) -> tuple[quota.Admission, T, str | None] | APIError:
    """``opener`` (``open_model``: route and send; the EPP's: route only) on the admitted
    model, then down its fallback chain when every endpoint failed before the first byte (or
    none was available); the admission that is being served (the fallback's, whose own quota
    was reserved, when it failed over), and why it failed over."""
    policy = ctx.view.policy
    failover = "quota" if adm.failover_from else None
    opened = await opener(state, ctx, adm.model, adm.prompt_tokens, adm.expected_output)
    if isinstance(opened, APIError) and opened.code == SPILL:
        spilled = await spill(state, ctx, adm, opener)
        if spilled is not None:
            return spilled
        ctx.no_spill = True  # it waits for its own pool after all
        opened = await opener(state, ctx, adm.model, adm.prompt_tokens, adm.expected_output)
    if not isinstance(opened, APIError):
        return adm, opened, failover
    if not ctx.route.failover or opened.code in ("overloaded",) or opened.status == 400:
        return opened
    reason = "slo" if opened.code == "slo_unattainable" else "upstream"
    for name in adm.model.fallback:
        if name not in ctx.route.models:
            continue
        fb = policy.models[name]
        # Raises 503 limiter_unavailable when the store is gone (the pipeline refunds what
        # this request holds); an admission is recorded in ctx.admissions.
        nxt = await admission.reserve(state, ctx, fb)
        if not nxt.decision.allowed or nxt.model is not fb:
            if nxt.decision.allowed:
                refund_later(ctx, nxt)
            continue
        attempt_ = await opener(state, ctx, fb, nxt.prompt_tokens, nxt.expected_output)
        if isinstance(attempt_, APIError):
            refund_later(ctx, nxt)
            continue
        state.metrics.series("failovers", reason, adm.model.name, fb.name).inc()
        refund_later(ctx, adm)
        return admission.adopt(ctx, nxt), attempt_, reason
    return opened


async def spill(state: GatewayState, ctx: RequestContext, adm: quota.Admission,
                opener: Opener[T]) -> tuple[quota.Admission, T, str] | None:
    """Serve a pay-as-you-go request from its model's spillover model (its own quota and
    price) while the model's pool is saturated; None when that model refuses it (quota) or
    cannot serve it, and the request then waits for its own pool."""
    assert adm.model.spillover is not None
    target = ctx.view.policy.models[adm.model.spillover]
    nxt = await admission.reserve(state, ctx, target)
    if not nxt.decision.allowed or nxt.model is not target:
        if nxt.decision.allowed:
            refund_later(ctx, nxt)
        return None
    opened = await opener(state, ctx, target, nxt.prompt_tokens, nxt.expected_output)
    if isinstance(opened, APIError):
        refund_later(ctx, nxt)
        return None
    state.metrics.series("failovers", "spillover", adm.model.name, target.name).inc()
    refund_later(ctx, adm)
    return admission.adopt(ctx, nxt), opened, "spillover"
