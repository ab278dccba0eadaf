"""One request's path: authenticate → parse → count → admit → route and send (``dispatch``)
→ answer (``respond``) → settle (``settle``), each in this package.

This is the only sequencer; each step lives in its own module. Every reservation admitted for
the request is settled exactly once, whatever happens after admission: the response's
``finally`` hands it to ``settle.finish`` with what was served, and anything that ends the
request before that -- the client leaving (which cancels this handler) while it waits for its
first token, queues for its SLO or is held during a scale-from-zero, a timeout, a parse error,
no endpoint, any exception -- returns it whole here (``settle_leftovers``), as if refused.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import re
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import orjson
from aiohttp import web

from gateway.config.policy import Policy
from gateway.front.http_guard import read_body
from gateway.quota import ledger as quota
from gateway.request import admission, fields, slo
from gateway.request.context import RequestContext
from gateway.request.dispatch import open_model, open_request
from gateway.request.respond import respond
from gateway.request.settle import refund_later
from gateway.state import GATEWAY, GatewayState
from protocol import logs
from protocol.errors import APIError, bad
from protocol.response_events import Shape
from protocol.responses import to_chat
from protocol.validate import GenerationRequest, Kind, load_json, validate

log = logging.getLogger("tokengate.gateway")
Headers = Mapping[str, str]  # a request's headers, case-insensitive (aiohttp's or the EPP's)
_REQUEST_ID = re.compile(r"^[\x21-\x7e]{1,128}$")  # printable ASCII, no spaces


def bearer(headers: Headers) -> str | None:
    """The credentials of ``Authorization: Bearer …`` (the scheme is case-insensitive, RFC
    9110 §11.1), or None."""
    scheme, _, token = headers.get("Authorization", "").strip().partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


def request_id(headers: Headers) -> str:
    """The client's ``X-Request-Id`` when it is printable ASCII (≤ 128), else a new one."""
    rid = headers.get("X-Request-Id")
    return rid if rid is not None and _REQUEST_ID.match(rid) else uuid.uuid4().hex


def authenticate(headers: Headers, policy: Policy) -> str:
    """The tenant of the request's bearer key (401 otherwise)."""
    token = bearer(headers)
    if token is None:
        raise APIError(401, "You didn't provide an API key. Send it as 'Authorization: "
                       "Bearer KEY'.", code="invalid_api_key")
    digest = hashlib.sha256(token.encode("utf-8", "surrogateescape")).hexdigest()
    found = policy.key_index.get(digest)
    if found is None or not any(hmac.compare_digest(digest, k.sha256)
                                for k in policy.tenants[found[0]].keys):
        raise APIError(401, "Incorrect API key provided.", code="invalid_api_key")
    return found[0]


def flow_id(headers: Headers, tenant: str) -> str:
    """The request's flow under flow control: its tenant, or finer when it names one
    (``x-fairness-id``, e.g. an agent session: printable ASCII, at most 128 characters)."""
    fid = headers.get("x-fairness-id")
    if fid is None:
        return tenant
    if not _REQUEST_ID.match(fid):
        raise bad("header x-fairness-id must be 1 to 128 printable ASCII characters without "
                  "spaces", "x-fairness-id")
    return f"{tenant}/{fid}"


def sees_endpoints(headers: Headers, state: GatewayState) -> bool:
    """May this request's answer name the engines that served it? With
    ``settings.expose_endpoints``, or when it carries the admin key in
    ``x-tokengate-admin-key``."""
    if state.view.policy.settings.expose_endpoints:
        return True
    digest = state.view.admin_digest
    return digest is not None and key_matches(headers.get("x-tokengate-admin-key"), digest)


def key_matches(key: str | None, digest: str) -> bool:
    """Is ``key`` the one whose SHA-256 is ``digest`` (compared in constant time)?"""
    got = hashlib.sha256(key.encode("utf-8", "surrogateescape")).hexdigest() if key else ""
    return hmac.compare_digest(got, digest)


def key_name(headers: Headers, policy: Policy) -> str:
    """The policy's name for the request's (authenticated) API key."""
    token = bearer(headers) or ""
    found = policy.key_index.get(
        hashlib.sha256(token.encode("utf-8", "surrogateescape")).hexdigest())
    return found[1] if found is not None else ""


def gate(state: GatewayState, headers: Headers) -> str:
    """The tenant, before any body is read: 503 while draining, 401 without a valid key."""
    if state.draining:
        raise APIError(503, "the gateway is shutting down", type="service_unavailable",
                       code="draining", headers={"retry-after": "1"})
    return authenticate(headers, state.view.policy)


def begin(state: GatewayState, tenant: str, headers: Headers, raw: bytes, kind: Kind,
          received: float, *, responses: bool = False) -> RequestContext:
    """Everything between the body and admission, for any front (``serve``'s HTTP handler,
    the EPP): parse and validate the body, find the route, read the SLO and priority
    headers, start the trace. ``responses``: the body is a Responses API request, served as
    the chat request it translates to (``protocol.responses``)."""
    view = state.view
    policy = view.policy
    body = load_json(raw)
    asked = None
    if responses:
        if not isinstance(body, dict):
            raise bad("the request body must be a JSON object")
        asked, body = body, to_chat(body)
        raw = orjson.dumps(body)
    g = validate(kind, body)
    messages = body.get("messages")
    if isinstance(messages, list) and len(messages) > policy.settings.max_messages:
        raise bad(f"too many messages: {len(messages)} > {policy.settings.max_messages}",
                  "input" if responses else "messages")
    ctx = context(state, tenant, headers, raw, received, kind, body, g)
    if asked is not None:
        ctx.responses = Shape(asked, ctx.request_id)
    return ctx


def context(state: GatewayState, tenant: str, headers: Headers, raw: bytes, received: float,
            kind: Kind, body: dict[str, Any], g: GenerationRequest, *,
            operation: str | None = None) -> RequestContext:
    """The request's context once its body is valid: its route (404 when the tenant may not
    use the model), SLO, priority, flow and key, its trace (``operation``: its name there,
    default ``kind``'s)."""
    view = state.view
    policy = view.policy
    route = policy.route_for(tenant, g.model)
    if route is None:
        raise APIError(404, f"The model `{g.model}` does not exist or you do not have access "
                       "to it.", param="model", code="model_not_found")
    dropped = fields.screen(operation or kind, body, policy.models[g.model],
                            policy.settings.unknown_fields)
    if dropped:  # what goes upstream is the body without them, never the raw bytes
        for k in dropped:
            del body[k]
        raw = orjson.dumps(body)
    ctx = RequestContext(state, view, kind, tenant, route, body, g, request_id(headers),
                         received, raw)
    logs.bind(ctx.request_id, tenant, g.model)
    ctx.slo = (slo.header(headers, "x-slo-ttft-ms", route.slo_ttft_ms),
               slo.header(headers, "x-slo-tpot-ms", route.slo_tpot_ms))
    ctx.priority = slo.priority(headers, policy.tenants[tenant])
    ctx.flow = flow_id(headers, tenant)
    ctx.key_name = key_name(headers, policy)
    ctx.sees_endpoints = sees_endpoints(headers, state)
    ctx.trace = state.tracer.request(operation or kind, g.model, headers, {
        "tokengate.tenant": ctx.tenant_label, "tokengate.route": route.name,
        "tokengate.request_id": ctx.request_id, "gen_ai.request.max_tokens": g.max_tokens,
        "tokengate.priority": ctx.priority})
    return ctx


def end_trace(ctx: RequestContext, exc: APIError | None) -> None:
    """Close the request's root span. Answered with an error, the trace is done; otherwise it
    stays on ``ctx``: settlement (a background task) adds its spans after this."""
    if ctx.trace is None:
        return
    if exc is not None:
        ctx.trace.root.set_attribute("http.response.status_code", exc.status)
        ctx.trace.end(ctx.trace.root, {"error.type": exc.code or str(exc.status)},
                      error=exc.message)
        ctx.trace = None
    else:
        ctx.trace.end(ctx.trace.root)


Begin = Callable[[GatewayState, str, Headers, bytes, float], RequestContext]
Serve = Callable[[web.Request, GatewayState, RequestContext], Awaitable[web.StreamResponse]]


async def handle(request: web.Request, kind: Kind, *, responses: bool = False
                 ) -> web.StreamResponse:
    return await run(request, lambda state, tenant, headers, raw, received: begin(
        state, tenant, headers, raw, kind, received, responses=responses), _serve)


async def run(request: web.Request, start: Begin, serve: Serve) -> web.StreamResponse:
    """One request on ``serve``'s front, for any API: the tenant, the body, ``start`` (the
    context), ``serve``; a refusal counted and recorded as spend, the trace ended."""
    received = time.perf_counter()
    state = request.app[GATEWAY]
    tenant = gate(state, request.headers)
    raw = await read_body(request, state.view.policy.settings.client.body_timeout_s)
    ctx = start(state, tenant, request.headers, raw, received)
    try:
        return await serve(request, state, ctx)
    except APIError as exc:
        ctx.finish(ctx.parsed.model, str(exc.status))
        ctx.spent(ctx.view.policy.models[ctx.parsed.model], 0, 0, 0, str(exc.status))
        end_trace(ctx, exc)
        raise
    except BaseException as exc:
        if ctx.outcome is None:  # no answer was handed back: left (or failed) before it
            outcome = "client_gone" if isinstance(exc, asyncio.CancelledError) else "500"
            ctx.finish(ctx.parsed.model, outcome)
            ctx.spent(ctx.view.policy.models[ctx.parsed.model], 0, 0, 0, outcome)
        raise
    finally:
        end_trace(ctx, None)
        for done in ctx.on_end:  # what the request held (a LoRA adapter on its endpoint)
            done()


async def _serve(request: web.Request, state: GatewayState, ctx: RequestContext
                 ) -> web.StreamResponse:
    adm = await admit(state, ctx)
    try:
        opened = await open_request(state, ctx, adm, open_model)
        if isinstance(opened, APIError):
            raise opened
        served, sent, failover = opened
        return await respond(request, ctx, served, sent, failover)
    finally:
        settle_leftovers(ctx)


async def admit(state: GatewayState, ctx: RequestContext) -> quota.Admission:
    span = ctx.trace.child("tokengate.admission") if ctx.trace is not None else None
    try:
        adm = await _reserve(state, ctx)
    except APIError as exc:
        if ctx.trace is not None:
            ctx.trace.end(span, {"tokengate.admitted": False, "error.type": exc.code},
                          error=exc.message)
        raise
    if ctx.trace is not None:
        ctx.trace.end(span, {
            "tokengate.admitted": True, "gen_ai.usage.input_tokens": adm.prompt_tokens,
            "tokengate.reserved_output_tokens": adm.expected_output,
            "tokengate.model": adm.model.name, "tokengate.failover_from": adm.failover_from})
    return adm


async def _reserve(state: GatewayState, ctx: RequestContext) -> quota.Admission:
    stop = state.sentry.check(ctx.view.policy.settings.sentry, ctx.tenant, ctx.session,
                              ctx.body, time.time())
    if stop is not None:
        raise stop
    model = ctx.view.policy.models[ctx.parsed.model]
    # the tenant's reserved throughput rides the quota's own reservation (one store call)
    adm = await admission.reserve(state, ctx, model)
    if not adm.decision.allowed:
        raise quota.rate_limit_error(adm.decision)
    admission.adopt(ctx, adm)
    state.metrics.series("tier_requests", adm.model.name, ctx.tier).inc()
    if adm.failover_from:
        state.metrics.series("failovers", "quota", adm.failover_from, adm.model.name).inc()
    return adm


def settle_leftovers(ctx: RequestContext) -> None:
    """Return every reservation the request still holds that no response will settle (runs
    in ``finally``, also when the handler is cancelled: the refund is a background task)."""
    left = [adm for adm in ctx.admissions if adm.open]
    for adm in left:
        refund_later(ctx, adm)
        turn = ctx.flow_passes.pop(adm.model.name, None)
        if turn is not None:  # nothing will be served on it: no fair-share charge
            turn.settled(0, 0)
