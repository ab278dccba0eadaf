"""``POST /v1/embeddings`` through the gateway: the inputs counted with the model's tokenizer
(token arrays as they are), the tokens reserved against the tenant's limits (TPM on input
tokens, RPM) with no output, routed like any prompt (load, queue and prefix; the flow gate
when the pool is saturated), sent whole to the endpoint's ``/v1/embeddings`` under the one
retry policy and down the fallback chain, answered with the engine's vectors under the
model's name, and settled with the engine's ``usage`` (checked against the gateway's count)
or the gateway's count."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import orjson
from aiohttp import web

from gateway.config.policy import Model
from gateway.quota import ledger as quota
from gateway.request import pipeline
from gateway.request.attempt import Attempt, judged, request_headers, retry
from gateway.request.context import RequestContext
from gateway.request.dispatch import embeddings_body, open_request, traced_route, upstream_span
from gateway.request.failure import answer_failure
from gateway.request.relay import RelayResult
from gateway.request.respond import headers
from gateway.request.settle import hand_back
from gateway.request.upstream import UpstreamResponse
from gateway.routing.router import Decision
from gateway.state import GatewayState
from protocol.embeddings import parse_embeddings
from protocol.errors import APIError
from protocol.validate import GenerationRequest, load_json


@dataclass(slots=True)
class Embedded:
    """An endpoint's whole answer (``attempt.Routed`` for headers and settlement)."""

    up: UpstreamResponse
    decision: Decision
    attempt: Attempt
    sent_at: float
    body: bytes
    prefill_used: bool = False

    @property
    def ttft_origin(self) -> float:
        return self.sent_at


async def handle(request: web.Request) -> web.StreamResponse:
    return await pipeline.run(request, begin, serve)


def begin(state: GatewayState, tenant: str, headers: pipeline.Headers, raw: bytes,
          received: float) -> RequestContext:
    body = load_json(raw)
    e = parse_embeddings(body)
    g = GenerationRequest("completion", e.model, max_tokens=0)
    ctx = pipeline.context(state, tenant, headers, raw, received, "completion", body, g,
                           operation="embeddings")
    ctx.embed_inputs = tuple(e.inputs)  # counted at admission (``RequestContext.count_prompt``)
    return ctx


async def serve(request: web.Request, state: GatewayState, ctx: RequestContext
                ) -> web.StreamResponse:
    adm = await pipeline.admit(state, ctx)
    try:
        opened = await open_request(state, ctx, adm, open_embeddings)
        if isinstance(opened, APIError):
            raise opened
        served, sent, failover = opened
        return answer(ctx, served, sent, failover)
    finally:
        pipeline.settle_leftovers(ctx)


def read_answer(raw: bytes, served: str, result: RelayResult) -> None:
    """An engine's embeddings answer into ``result``: its body under the model's name
    ``served`` and its usage (no completion); a malformed one marks ``result`` broken and
    raises the 502 to answer (``serve`` and the EPP alike)."""
    try:
        obj = orjson.loads(raw)
        if not isinstance(obj, dict) or not isinstance(obj.get("data"), list):
            raise ValueError("no data")
        obj["model"] = served
        usage = obj.get("usage")
        if isinstance(usage, dict):
            result.usage = {**usage, "completion_tokens": 0}
        result.body = orjson.dumps(obj)
        result.done = True
    except ValueError:
        result.status, result.broken = 502, True
        raise APIError(502, "the upstream's embeddings answer is malformed",
                       type="server_error", code="upstream_error") from None


def answer(ctx: RequestContext, adm: quota.Admission, sent: Embedded, failover: str | None
           ) -> web.Response:
    """The engine's answer under the model's name, settled (in the background) with its
    usage."""
    result = RelayResult(status=200)
    try:
        read_answer(sent.body, adm.model.name, result)
    finally:
        hand_back(ctx, adm, result, sent)
    assert result.body is not None
    return web.Response(status=200, body=result.body, headers={
        **headers(ctx, adm, sent, failover), "Content-Type": "application/json"})


async def open_embeddings(state: GatewayState, ctx: RequestContext, m: Model,
                          prompt_tokens: int, reserved: int) -> Embedded | APIError:
    """Route, then send to the chosen endpoint's ``/embeddings``, re-deciding without it
    until one answers (``dispatch.Opener``)."""
    routed = await traced_route(state, ctx, m, prompt_tokens, 0)
    if isinstance(routed, APIError):
        return routed
    router, info, first = routed
    pool = router.pool
    body = embeddings_body(ctx, m)
    t = ctx.route.timeouts

    async def try_one(decision: Decision, n: int) -> Embedded:
        ep = decision.endpoint.ep
        state.metrics.series("routing_decisions", m.name, router.strategy, ep.url,
                             "sole").inc()
        a = Attempt(state, ctx, pool, ep, prompt_tokens, decision.endpoint.uncached_tokens,
                    upstream_span(ctx, m, ep.url, False, n))
        sent_at = time.perf_counter()

        async def whole() -> tuple[UpstreamResponse, bytes]:
            async with asyncio.timeout(t.total_s):
                up = await state.upstream.post(
                    ep.url + "/embeddings", body, request_headers(ctx, a),
                    connect_timeout_s=t.connect_s, ca_file=ep.ca_file)
                if up.status != 200:
                    raise await answer_failure(up, ep, pool)
                return up, await up.read()

        up, data = await judged(a, whole())
        up.release()
        a.first_token()  # the whole answer is in: the inputs were computed
        router.commit(decision, info)
        return Embedded(up, decision, a, sent_at, data)

    return await retry(state, ctx, router, info, first, [], try_one,
                       APIError(502, f"no endpoint of {m.name} answered", type="server_error",
                                code="upstream_unavailable"), m.name)
