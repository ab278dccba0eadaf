"""Answering the client from an opened upstream response: a stream relayed event by event
(moved to another endpoint when its own is drained), or a whole body. Whatever happens here
(the client leaves, the upstream breaks, a timeout), the endpoint's counters are given back and
settlement (``gateway.request.settle``) is started exactly once, in ``finally``."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator

from aiohttp import web

from gateway.quota import ledger as quota
from gateway.request import responses
from gateway.request.aggregate import Aggregate
from gateway.request.attempt import Routed, Sent, continue_stream
from gateway.request.context import RequestContext
from gateway.request.migrate import Live
from gateway.request.relay import RelayResult, Sink, relay_stream
from gateway.request.responses import EventSink
from gateway.request.settle import hand_back
from protocol.errors import APIError
from protocol.response_events import EventStream

_MIGRATION_FAILED = (b'data: {"error": {"message": "the stream could not be moved to another '
                     b'endpoint", "type": "server_error", "param": null, "code": '
                     b'"migration_failed"}}\n\ndata: [DONE]\n\n')


def headers(ctx: RequestContext, adm: quota.Admission, sent: Routed, failover: str | None
            ) -> dict[str, str]:
    d = sent.decision
    h = {"x-request-id": ctx.request_id,
         "x-tokengate-model": adm.model.name,
         "x-tokengate-prompt-tokens": str(adm.prompt_tokens),  # as the gateway counted them
         "x-tokengate-tier": ctx.tier,
         "x-tokengate-priority": ctx.priority}  # the band served (capped by the tenant's)
    if ctx.sees_endpoints:  # an internal address: not told to tenants unless configured
        h["x-tokengate-endpoint"] = d.endpoint.ep.url
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


async def respond(request: web.Request, ctx: RequestContext, adm: quota.Admission,
                  sent: Sent, failover: str | None) -> web.StreamResponse:
    state = ctx.state
    sent.attempt.relay()
    state.metrics.overhead.observe(sent.sent_at - ctx.received_at)
    result = RelayResult(status=sent.up.status)
    current = [sent]  # the Sent being relayed (a migration replaces it)
    try:
        h = headers(ctx, adm, sent, failover)
        if ctx.parsed.stream:
            return await _stream(request, ctx, adm, current, result, h)
        return await _whole(ctx, adm, sent, result, h)
    except asyncio.CancelledError:
        result.client_gone = True  # the client left (aiohttp cancels its handler)
        raise
    finally:
        s = current[0]
        s.up.release()
        hand_back(ctx, adm, result, s)


async def _stream(request: web.Request, ctx: RequestContext, adm: quota.Admission,
                  current: list[Sent], result: RelayResult, h: dict[str, str]
                  ) -> web.StreamResponse:
    state = ctx.state
    policy = ctx.view.policy
    t = ctx.route.timeouts
    sent = current[0]
    assert sent.lines is not None
    resp = web.StreamResponse(status=200, headers={
        **h, "Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    sink: Sink = resp
    if ctx.responses is not None:  # chat events out as the Responses API's
        sink = EventSink(resp, EventStream(ctx.responses, adm.model.name), lambda: {
            "prompt_tokens": adm.prompt_tokens, "completion_tokens": result.chunks})

    async def progress(n: int) -> None:
        await quota.charge_progress(state.store, adm, n)

    shift = 0
    while True:
        sent = current[0]
        assert sent.lines is not None
        ep = sent.decision.endpoint.ep

        # Streams of pools that scale may be moved off a draining endpoint.
        live = Live(ep.url, sent.up.abort) if adm.model.scaling is not None else None
        if live is not None:
            state.live.add(live)
        try:
            await relay_stream(
                sent.lines, sink, upstream_model=adm.model.upstream_name,
                served_model=adm.model.name, pass_usage=ctx.parsed.include_usage,
                on_tokens=progress, every=policy.settings.progressive_charge_tokens,
                every_s=policy.settings.progressive_charge_ms / 1000.0, into=result,
                on_first=sent.attempt.first_token, gap_s=t.between_tokens_s,
                deadline_s=t.total_s - (time.perf_counter() - sent.sent_at),
                live=live, usage_shift=shift, tally=ep.live)
        finally:
            if live is not None:
                state.live.remove(live)
        if not result.migrated or live is None:
            break
        moved = await continue_stream(state, ctx, adm, sent, live, result.chunks)
        if moved is None:
            result.broken = True
            await sink.write(_MIGRATION_FAILED)
            break
        # Hand over: the old endpoint's share goes back, the new one's is taken.
        sent.up.release()
        sent.attempt.close()
        current[0], shift = moved, result.chunks
        moved.attempt.relay()
        result.migrated = False
    if not result.client_gone:
        await resp.write_eof()
    return resp


async def _whole(ctx: RequestContext, adm: quota.Admission, sent: Sent, result: RelayResult,
                 h: dict[str, str]) -> web.Response:
    """A client that did not ask for a stream: the upstream's stream is relayed into an
    ``Aggregate`` (charged progressively as it grows), then answered as one JSON object. If
    the client leaves meanwhile its handler is cancelled here, which closes the upstream's
    stream (the engine stops) and settles what the engine generated until then."""
    assert sent.lines is not None
    body = await aggregate(ctx, adm, sent, result, sent.lines)
    if body is None:
        raise APIError(502, "the upstream's answer broke off before it was complete",
                       type="server_error", code="upstream_error")
    if ctx.responses is not None:
        body = responses.whole(ctx.responses, body)
    return web.Response(status=200, body=body, headers={**h, "Content-Type": "application/json"})


async def aggregate(ctx: RequestContext, adm: quota.Admission, sent: Routed,
                    result: RelayResult, lines: AsyncIterator[bytes]) -> bytes | None:
    """Relay the engine's stream (``lines``) into an ``Aggregate``: the answer's body, or
    None when the stream broke (``result.broken``)."""
    state, policy, t = ctx.state, ctx.view.policy, ctx.route.timeouts
    agg = Aggregate(ctx.kind)

    async def progress(n: int) -> None:
        await quota.charge_progress(state.store, adm, n)

    await relay_stream(
        lines, agg, upstream_model=adm.model.upstream_name, served_model=adm.model.name,
        pass_usage=True, on_tokens=progress, every=policy.settings.progressive_charge_tokens,
        every_s=policy.settings.progressive_charge_ms / 1000.0, into=result,
        on_first=sent.attempt.first_token, gap_s=t.between_tokens_s, deadline_s=t.total_s -
        (time.perf_counter() - sent.ttft_origin), tally=sent.decision.endpoint.ep.live)
    if result.broken:
        return None
    usage = {"prompt_tokens": adm.prompt_tokens, "completion_tokens": result.chunks,
             "total_tokens": adm.prompt_tokens + result.chunks}
    result.body = agg.body(usage=usage)
    return result.body
