"""Sending a request to one endpoint: an attempt (and, for a stream, waiting for its first
event, so a failure before it can still be retried elsewhere), how its failures are
classified for the retry loop in ``gateway.pipeline``, and continuing a stream on another
endpoint when its own is drained (``gateway.migrate``)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import aiohttp
import orjson

from gateway import migrate, quota
from gateway.config.resilience import Timeouts
from gateway.context import RequestContext
from gateway.endpoints import EndpointPool, EndpointState, Ticket
from gateway.errors import APIError
from gateway.migrate import Live
from gateway.routing.plugins import RequestInfo
from gateway.routing.router import Decision
from gateway.state import GatewayState
from gateway.upstream import UpstreamBroken, UpstreamResponse

log = logging.getLogger("tokengate.gateway")


@dataclass(slots=True)
class Sent:
    """An upstream response being relayed, and what routing decided and promised for it."""

    up: UpstreamResponse
    decision: Decision
    pool: EndpointPool
    ticket: Ticket  # this request's share of the endpoint's live counters
    sent_at: float
    prefill_used: bool = False
    lines: AsyncIterator[bytes] | None = None  # a stream's events, the first already read
    info: RequestInfo | None = None  # what routing knew of the request (to re-route it)
    # when the request's first upstream call went out: the prefill's when it was prefilled
    # elsewhere, else ``sent_at``; TTFT is observed from here, as the client sees it
    started_at: float | None = None

    @property
    def ttft_origin(self) -> float:
        return self.started_at if self.started_at is not None else self.sent_at


async def attempt(state: GatewayState, ctx: RequestContext, pool: EndpointPool,
                  ep: EndpointState, url: str, body: bytes, t: Timeouts
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


class Failure(Exception):
    """One attempt failed in a way another endpoint may not: retry (``backoff`` says whether
    to pause first: overload answers and stalls, not refused connections)."""

    def __init__(self, error: APIError, kind: str, backoff: bool) -> None:
        super().__init__(error.message)
        self.error, self.kind, self.backoff = error, kind, backoff


def upstream_failure(exc: BaseException, stream: bool) -> Failure:
    if isinstance(exc, TimeoutError):
        what = "first token" if stream else "response"
        return Failure(APIError(504, f"the upstream did not send its {what} in time",
                                type="server_error", code="upstream_timeout"), "timeout", True)
    refused = isinstance(exc, ConnectionRefusedError)
    return Failure(APIError(502, "the upstream could not be reached" if refused else
                            "the upstream closed the connection", type="server_error",
                            code="upstream_unavailable"),
                   "connect" if refused else "broken", not refused)


async def continue_stream(state: GatewayState, ctx: RequestContext, adm: quota.Admission,
                          sent: Sent, live: Live, generated: int) -> Sent | None:
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
            up, lines = await attempt(state, ctx, pool, ep, ep.url + path, raw,
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
        return Sent(up, decision, pool, ticket, time.perf_counter(), False, lines, info)
    state.metrics.series("migrations", m.name, "failed").inc()
    return None
