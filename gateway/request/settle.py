"""After the response: settle the quota with what was really served, count the request in the
metrics, and feed the predictor what the request saw against what it was routed on. Runs in a
background task, so a client that disconnected is settled too.

What is charged (``served``):

* a stream that ran to its ``[DONE]`` with the client there to the end: the upstream's
  ``usage`` (prompt and completion tokens);
* any other stream that wrote tokens to the client (it left, the upstream broke or stalled,
  no usage came): the tokens the relay wrote, counted from the events themselves, plus the
  prompt (the upstream's count when its usage arrived, else the gateway's);
* a non-streamed answer (built from the upstream's stream, ``gateway.request.aggregate``) relayed
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
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from gateway.log_throttle import UPSTREAM
from gateway.quota import ledger as quota
from gateway.quota.limiter.store import StoreUnavailable
from gateway.request.attempt import Routed
from gateway.request.context import RequestContext
from gateway.request.relay import RelayResult
from gateway.routing import feedback

log = logging.getLogger("tokengate.gateway")


def observe(ctx: RequestContext, r: RelayResult, sent: Routed) -> None:
    """Feed routing what this request saw, against what it was routed on."""
    if not ctx.parsed.stream or r.first_token_at is None or r.broken:
        return
    s = feedback.seen(sent.decision, sent.prefill_used, sent.ttft_origin, r.first_token_at,
                      r.last_token_at, r.chunks)
    samples = feedback.learn(s, ctx.state.predictor, sent_at=sent.ttft_origin)
    if ctx.state.sync is not None:
        for target, row, y in samples:
            ctx.state.sync.queue_sample(target, row, y)


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
    # images are reserved by an estimate: the engine's count is held to the looser bound
    exact = not ctx.parsed.images.count and (
        ctx.kind != "chat" or (counter is not None and counter.mode != "openai"))

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
                      used: Served | None, routed: Routed) -> None:
    t = ctx.trace
    assert t is not None
    usage = {"gen_ai.usage.input_tokens": used.prompt if used else None,
             "gen_ai.usage.output_tokens": used.completion if used else None,
             "gen_ai.response.model": adm.model.upstream_name}
    err = "client left" if r.client_gone else "stream broke" if r.broken else None
    ttft = (r.first_token_at - ctx.received_at) if r.first_token_at is not None else None
    routed.attempt.end_span({**usage, "http.response.status_code": r.status,
                             "tokengate.ttft_s": ttft}, error=err)
    span = t.child("tokengate.settlement", {
        **usage, "tokengate.reserved_tokens": adm.prompt_tokens + adm.expected_output,
        "tokengate.charged_tokens": used.prompt + used.completion if used else 0,
        "tokengate.refunded": used is None})
    t.end(span, error=err)


def hand_back(ctx: RequestContext, adm: quota.Admission, r: RelayResult, routed: Routed
              ) -> None:
    """The end of an answer, however it ended: the attempt is handed back (its endpoint's
    health judged by how the answer went), the request counted by how it ended, and
    settlement started in the background (once)."""
    if r.broken:
        routed.attempt.broke()
    elif r.status == 200 and not r.client_gone:
        routed.attempt.succeeded()
    else:
        routed.attempt.close()
    ctx.finish(adm.model.name, "client_gone" if r.client_gone else "broken" if r.broken
               else str(r.status))
    adm.settling = True
    ctx.state.spawn(finish(ctx, adm, r, routed))


async def finish(ctx: RequestContext, adm: quota.Admission, r: RelayResult, sent: Routed
                 ) -> None:
    """Settle quota and record metrics for a proxied request (runs even after a disconnect)."""
    state = ctx.state
    m = adm.model.name
    used = await served(ctx, adm, r)
    turn = ctx.flow_passes.pop(m, None)
    if turn is not None:  # its fair-share charge becomes what it was served
        turn.settled(*((used.prompt, used.completion) if used is not None else (0, 0)))
    if used is not None and used.rejected:
        _distrust(ctx, sent, used)
    if ctx.trace is not None:
        _trace_settlement(ctx, adm, r, used, sent)
    try:
        if used is None:
            await quota.refund(state.store, adm)
        else:
            await quota.settle(state.store, adm, output_tokens=used.completion,
                               prompt_tokens=used.prompt, failed_before_first_token=False,
                               tier=ctx.tier)
    except StoreUnavailable:
        log.warning("settlement of %s deferred: the rate store is unreachable", ctx.request_id)
    details = (r.usage or {}).get("prompt_tokens_details")
    cached = _count(details, "cached_tokens") if isinstance(details, dict) else None
    outcome = "client_gone" if r.client_gone else "broken" if r.broken else str(r.status)
    ctx.spent(adm.model, used.prompt if used else 0, used.completion if used else 0,
              min(cached or 0, used.prompt) if used else 0, outcome,
              sent.decision.endpoint.ep.url)
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
    UPSTREAM.warning(log, ("usage", ep.url), "endpoint %s reported implausible %s for %s: "
                     "charged the gateway's count (%d prompt, %d completion)", ep.url,
                     " and ".join(used.rejected), ctx.request_id, used.prompt, used.completion)
    sent.attempt.misreported(used.rejected)
