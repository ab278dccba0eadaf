"""After the response: settle the quota with what was really used, count the request in the
metrics, and feed the predictor what the request saw against what it was routed on. Runs in a
background task, so a client that disconnected is settled too."""

from __future__ import annotations

import logging
import math

from gateway import quota
from gateway.attempt import Sent
from gateway.context import RequestContext
from gateway.limiter.store import StoreUnavailable
from gateway.relay import RelayResult

log = logging.getLogger("tokengate.gateway")


# TPOT is learned and scored only over streams of at least this many tokens: over one or two
# gaps it is a single step's time, decided by whether a prefill chunk shared that step, which
# no feature of the endpoint can tell in advance.
TPOT_MIN_TOKENS = 8


def observe(ctx: RequestContext, r: RelayResult, sent: Sent) -> None:
    """Feed the predictor what this request saw, against the features it was routed on."""
    if not ctx.parsed.stream or r.first_token_at is None or r.broken:
        return
    state, d = ctx.state, sent.decision
    ttft_ms = (r.first_token_at - sent.ttft_origin) * 1000.0
    tpot_ms = ((r.last_token_at - r.first_token_at) * 1000.0 / (r.chunks - 1)
               if r.last_token_at is not None and r.chunks >= TPOT_MIN_TOKENS else None)
    lead = d.prefill if (d.prefill is not None and sent.prefill_used) else d.endpoint
    lead.ep.observed(ttft_ms, None)
    d.endpoint.ep.observed(None, tpot_ms)
    if lead.row is not None:
        state.predictor.observe(lead.row, ttft_ms=ttft_ms, tpot_ms=None,
                                predicted_ttft_ms=lead.ttft_ms, sent_at=sent.ttft_origin)
        if state.sync is not None:
            state.sync.queue_sample("ttft", lead.row, math.log(max(ttft_ms, 1e-3)))
    if d.endpoint.row is not None and tpot_ms is not None:
        state.predictor.observe(d.endpoint.row, ttft_ms=None, tpot_ms=tpot_ms,
                                predicted_tpot_ms=d.endpoint.tpot_ms, sent_at=sent.ttft_origin)
        if state.sync is not None:
            state.sync.queue_sample("tpot", d.endpoint.row, math.log(max(tpot_ms, 1e-3)))


async def finish(ctx: RequestContext, adm: quota.Admission, r: RelayResult, sent: Sent) -> None:
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
        observe(ctx, r, sent)
        state.metrics.series("prompt_tokens", m, ctx.tenant).inc(
            int(prompt) if isinstance(prompt, int) else adm.prompt_tokens)
        state.metrics.series("completion_tokens", m, ctx.tenant).inc(int(output))
        if ctx.parsed.stream and r.first_token_at is not None:
            state.metrics.series("ttft", m).observe(r.first_token_at - ctx.received_at)
            if r.last_token_at is not None and r.chunks > 1:
                state.metrics.series("tpot", m).observe(
                    (r.last_token_at - r.first_token_at) / (r.chunks - 1))
