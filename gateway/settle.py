"""After the response: settle the quota with what was really served, count the request in the
metrics, and feed the predictor what the request saw against what it was routed on. Runs in a
background task, so a client that disconnected is settled too.

What is charged (``served``):

* a stream that ran to its ``[DONE]`` with the client there to the end: the upstream's
  ``usage`` (prompt and completion tokens);
* any other stream that wrote tokens to the client (it left, the upstream broke or stalled,
  no usage came): the tokens the relay wrote, counted from the events themselves, plus the
  prompt (the upstream's count when its usage arrived, else the gateway's);
* a non-streamed answer (built from the upstream's stream, ``gateway.aggregate``) relayed
  whole: its ``usage``, or without one the gateway's prompt count and the tokens it counted;
* a non-streamed request whose client left before the answer was complete: the prompt, once
  the engine had produced a token, plus every token it produced until the gateway closed
  its stream (the engine stops there): work done is charged;
* anything else (no token reached the client, or the upstream broke before a non-streamed
  answer was complete): nothing -- the whole reservation, the request included, is
  returned, exactly as if it had been refused.

Every count the upstream reports is checked against the gateway's own (``bounded``).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from gateway import quota
from gateway.attempt import Routed
from gateway.context import RequestContext
from gateway.limiter.store import StoreUnavailable
from gateway.relay import RelayResult
from protocol import logs

log = logging.getLogger("tokengate.gateway")


# TPOT is learned and scored only over streams of at least this many tokens: over one or two
# gaps it is a single step's time, decided by whether a prefill chunk shared that step, which
# no feature of the endpoint can tell in advance.
TPOT_MIN_TOKENS = 8


def observe(ctx: RequestContext, r: RelayResult, sent: Routed) -> None:
    """Feed the predictor what this request saw, against the features it was routed on."""
    if not ctx.parsed.stream or r.first_token_at is None or r.broken:
        return
    state, d = ctx.state, sent.decision
    ttft_ms = (r.first_token_at - sent.ttft_origin) * 1000.0
    tpot_ms = ((r.last_token_at - r.first_token_at) * 1000.0 / (r.chunks - 1)
               if r.last_token_at is not None and r.chunks >= TPOT_MIN_TOKENS else None)
    lead = d.prefill if (d.prefill is not None and sent.prefill_used) else d.endpoint
    lead.ep.live.observed(ttft_ms, None)
    d.endpoint.ep.live.observed(None, tpot_ms)
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


def _count(u: dict[str, Any], key: str) -> int | None:
    v = u.get(key)
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None


# Reported usage is believed only within these bounds of the gateway's own count; outside them
# it is logged, counted (``tokengate_usage_rejected_total``), held against the endpoint's
# health, and replaced by the gateway's count.
COMPLETION_SLACK = 16  # completion: at most this many tokens more than the gateway counted
# prompt: within a factor of the gateway's count, give or take 16 tokens: 1.25 when its count is
# exact (the model's tokenizer and template), 2 when it is OpenAI's accounting (an estimate of
# an engine's template)
PROMPT_FACTOR = {True: 1.25, False: 2.0}
PROMPT_SLACK = 16


@dataclass(slots=True)
class Served:
    """What a request is charged, and which reported counts were refused."""

    prompt: int
    completion: int
    rejected: tuple[str, ...] = ()


async def bounded(adm: quota.Admission, prompt: int | None, completion: int | None,
                  chunks: int, text_tokens: Callable[[], Awaitable[int]], *,
                  prompt_exact: bool) -> Served:
    """The upstream's usage where it is plausible, else the gateway's own counts.

    The gateway counts one token per chunk relayed; an engine may send more than one per
    chunk (vLLM when its client falls behind, or while it holds text back for a stop string).
    So the completion must be at least the chunks, at most the ``max_tokens`` the engine was
    held to, and at most the chunks plus ``COMPLETION_SLACK`` -- or, beyond that, the relayed
    text re-tokenized with the model's tokenizer (``text_tokens``, only then) plus the slack.
    Without a usage, or refused, the completion is the chunks. The prompt must be within
    ``PROMPT_FACTOR`` and ``PROMPT_SLACK`` of the gateway's count, else it is that count."""
    rejected = []
    cap = adm.expected_output
    own = min(chunks, cap)
    if completion is None:
        completion = own
    elif not chunks <= completion <= min(cap, chunks + COMPLETION_SLACK) and not (
            chunks <= completion <= cap
            and completion <= await text_tokens() + COMPLETION_SLACK):
        rejected.append("completion_tokens")
        completion = own
    own_prompt = adm.prompt_tokens
    f = PROMPT_FACTOR[prompt_exact]
    if prompt is None:
        prompt = own_prompt
    elif not own_prompt / f - PROMPT_SLACK <= prompt <= own_prompt * f + PROMPT_SLACK:
        rejected.append("prompt_tokens")
        prompt = own_prompt
    return Served(prompt, completion, tuple(rejected))


async def served(ctx: RequestContext, adm: quota.Admission, r: RelayResult) -> Served | None:
    """What to charge, or None when nothing was served."""
    usage = r.usage or {}
    prompt, output = _count(usage, "prompt_tokens"), _count(usage, "completion_tokens")
    counter = ctx.view.counters.get(adm.model.name)
    exact = ctx.kind != "chat" or (counter is not None and counter.mode != "openai")

    async def text_tokens() -> int:
        if counter is None or not r.texts:
            return 0
        return await counter.generated("".join(r.texts))

    complete = r.done and not r.broken and not r.client_gone
    if ctx.parsed.stream:
        if r.chunks == 0 and not (complete and prompt is not None and output is not None):
            return None
        # A stream cut short is charged what was relayed (its usage, if any, cannot cover
        # tokens the client never got); only its prompt count is taken from the upstream.
        return await bounded(adm, prompt, output if complete else None, r.chunks,
                             text_tokens, prompt_exact=exact)
    if r.client_gone:
        # The client left before its answer was complete: the upstream's stream was closed
        # (the engine stopped). Charged the prompt once the engine had produced a token (its
        # prefill ran) and every token it produced until then.
        return await bounded(adm, prompt, None, r.chunks, text_tokens, prompt_exact=exact) \
            if r.chunks else None
    if r.status != 200 or r.body is None or r.broken:
        return None  # the client got an error in place of the answer
    return await bounded(adm, prompt, output, r.chunks, text_tokens, prompt_exact=exact)


def refund_later(ctx: RequestContext, adm: quota.Admission) -> None:
    """Return ``adm``'s whole reservation in a background task (immune to the request's
    cancellation); it is marked as being settled at once, so nothing settles it twice."""
    adm.settling = True
    ctx.state.spawn(_refund(ctx, adm))


async def _refund(ctx: RequestContext, adm: quota.Admission) -> None:
    try:
        await quota.refund(ctx.state.store, adm)
    except StoreUnavailable:
        log.warning("refund of %s deferred: the rate store is unreachable", ctx.request_id)


def _trace_settlement(ctx: RequestContext, adm: quota.Admission, r: RelayResult,
                      used: Served | None) -> None:
    t = ctx.trace
    assert t is not None
    usage = {"gen_ai.usage.input_tokens": used.prompt if used else None,
             "gen_ai.usage.output_tokens": used.completion if used else None,
             "gen_ai.response.model": adm.model.upstream_name}
    err = "client left" if r.client_gone else "stream broke" if r.broken else None
    if t.upstream is not None:
        ttft = (r.first_token_at - ctx.received_at) if r.first_token_at is not None else None
        t.end(t.upstream, {**usage, "http.response.status_code": r.status,
                           "tokengate.ttft_s": ttft}, error=err)
        t.upstream = None
    span = t.child("tokengate.settlement", {
        **usage, "tokengate.reserved_tokens": adm.prompt_tokens + adm.expected_output,
        "tokengate.charged_tokens": used.prompt + used.completion if used else 0,
        "tokengate.refunded": used is None})
    t.end(span, error=err)


def hand_back(ctx: RequestContext, adm: quota.Admission, r: RelayResult, routed: Routed
              ) -> None:
    """The end of an answer, however it ended: the endpoint's counters go back, its health
    is judged by how the answer went, and settlement starts in the background (once)."""
    state = ctx.state
    ep, pool = routed.decision.endpoint.ep, routed.pool
    pool.release(routed.ticket)
    state.metrics.series("in_flight", ep.url).dec()
    if r.broken:
        pool.failed(ep, transport=True)
        state.fleet.suspect(ep)
    elif r.status == 200 and not r.client_gone:
        pool.succeeded(ep)
    adm.settling = True
    state.spawn(finish(ctx, adm, r, routed))


async def finish(ctx: RequestContext, adm: quota.Admission, r: RelayResult, sent: Routed
                 ) -> None:
    """Settle quota and record metrics for a proxied request (runs even after a disconnect)."""
    state = ctx.state
    m = adm.model.name
    used = await served(ctx, adm, r)
    if used is not None and used.rejected:
        _distrust(ctx, sent, used)
    if ctx.trace is not None:
        _trace_settlement(ctx, adm, r, used)
    try:
        if used is None:
            await quota.refund(state.store, adm)
        else:
            await quota.settle(state.store, adm, output_tokens=used.completion,
                               prompt_tokens=used.prompt, failed_before_first_token=False)
    except StoreUnavailable:
        log.warning("settlement of %s deferred: the rate store is unreachable", ctx.request_id)
    status = ("client_gone" if r.client_gone else "broken" if r.broken else str(r.status))
    state.metrics.series("requests", ctx.route.name, m, ctx.tenant_label, status).inc()
    logs.outcome(status)
    if r.client_gone:
        state.metrics.series("abandoned", m, "generating" if r.chunks else "queued").inc()
    if used is not None and r.status == 200 and not r.broken:
        observe(ctx, r, sent)
        state.metrics.series("prompt_tokens", m, ctx.tenant_label).inc(used.prompt)
        state.metrics.series("completion_tokens", m, ctx.tenant_label).inc(used.completion)
        if ctx.parsed.stream and r.first_token_at is not None:
            state.metrics.series("ttft", m).observe(r.first_token_at - ctx.received_at)
            if r.last_token_at is not None and r.chunks > 1:
                state.metrics.series("tpot", m).observe(
                    (r.last_token_at - r.first_token_at) / (r.chunks - 1))


def _distrust(ctx: RequestContext, sent: Routed, used: Served) -> None:
    """The endpoint reported usage the gateway cannot believe: log it, count it, and hold it
    against the endpoint's health (it is charged by the gateway's own count)."""
    ep = sent.decision.endpoint.ep
    log.warning("endpoint %s reported implausible %s for %s: charged the gateway's count "
                "(%d prompt, %d completion)", ep.url, " and ".join(used.rejected),
                ctx.request_id, used.prompt, used.completion)
    for f in used.rejected:
        ctx.state.metrics.series("usage_rejected", ep.url, f).inc()
    sent.pool.failed(ep, transport=False)
