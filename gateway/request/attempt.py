"""Sending a request to one endpoint: the ``Attempt`` that owns it from its ticket to its
hand-back, sending it (and, for a stream, waiting for its first event, so a failure before it
can still be retried elsewhere), the one retry loop (``retry``: first attempts and migrations
alike), and continuing a stream on another endpoint when its own is drained
(``gateway.request.migrate``). How a failure is judged: ``gateway.request.failure``."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import orjson
from opentelemetry.trace import Span

from gateway.config.resilience import Timeouts, first_token_wait
from gateway.quota import ledger as quota
from gateway.request import migrate
from gateway.request.context import RequestContext
from gateway.request.failure import (
    SUSPECT_KINDS,
    TRANSPORT_KINDS,
    Failure,
    answer_failure,
    judge_error_event,
    upstream_failure,
)
from gateway.request.migrate import Live
from gateway.request.relay import BadEvent, event_payload, parse_event
from gateway.request.upstream import (
    UpstreamBroken,
    UpstreamError,
    UpstreamProtocolError,
    UpstreamResponse,
)
from gateway.routing.endpoints import EndpointPool, EndpointState, Ticket
from gateway.routing.plugins import RequestInfo
from gateway.routing.retry import Retrier
from gateway.routing.router import Decision, Router
from gateway.state import GatewayState
from protocol.errors import APIError

log = logging.getLogger("tokengate.gateway")
OUT_GRACE_S = 0.25  # a request waiting for its first token leaves an endpoint still out then


class Attempt:
    """One attempt on one endpoint, from its ticket to its hand-back. It alone takes and
    gives back the ticket (the endpoint's live counters), moves the in-flight gauge, ends the
    upstream span and judges the endpoint's health by how the attempt went; ``close`` (and
    each ending) happens once, whoever calls it."""

    __slots__ = ("closed", "ep", "pool", "predicted_ttft_s", "relaying", "span", "state",
                 "ticket", "trace")

    def __init__(self, state: GatewayState, ctx: RequestContext | None, pool: EndpointPool,
                 ep: EndpointState, tokens: int, prefill_tokens: int,
                 span: Span | None = None) -> None:
        self.state, self.pool, self.ep = state, pool, ep
        self.trace = ctx.trace if ctx is not None else None
        self.span = span  # the call to the engine (its context goes in the request headers)
        self.ticket: Ticket = pool.acquire(ep, tokens, prefill_tokens)
        self.relaying = False
        self.closed = False
        self.predicted_ttft_s: float | None = None  # routing's prediction (first-token wait)

    def trace_headers(self) -> dict[str, str]:
        """``traceparent`` of the upstream span: the engine's own spans join the trace."""
        if self.trace is None or self.span is None:
            return {}
        return self.trace.headers(self.span)

    def first_token(self) -> None:
        """The first token came: the prompt is computed (the endpoint's queue moves on)."""
        self.pool.first_token(self.ticket)

    def relay(self) -> None:
        """The endpoint's answer is being relayed: it counts as in flight until closed."""
        if not self.relaying and not self.closed:
            self.relaying = True
            self.state.metrics.series("in_flight", self.ep.url).inc()

    def end_span(self, attrs: dict[str, Any], error: str | None = None) -> None:
        if self.trace is not None and self.span is not None:
            self.trace.end(self.span, attrs, error=error)
            self.span = None

    def failed(self, f: Failure) -> None:
        """It failed before its answer began: judged (an endpoint fault counts against the
        endpoint), its span ended, closed."""
        if f.endpoint_fault:
            self.pool.failed(self.ep, transport=f.kind in TRANSPORT_KINDS)
            if f.kind in SUSPECT_KINDS:
                self.state.fleet.suspect(self.ep)
            self.state.metrics.series("upstream_errors", self.ep.url, f.kind).inc()
        self.end_span({"error.type": f.kind}, f.error.message)
        self.close()

    def broke(self) -> None:
        """Its answer broke off: the endpoint is held at fault and probed; closed."""
        if not self.closed:
            self.pool.failed(self.ep, transport=True)
            self.state.fleet.suspect(self.ep)
        self.close()

    def misreported(self, fields: tuple[str, ...]) -> None:
        """Its engine reported usage that could not be believed (``settle.bounded``): counted
        and held against the endpoint's health, even after the hand-back."""
        for f in fields:
            self.state.metrics.series("usage_rejected", self.ep.url, f).inc()
        self.pool.failed(self.ep, transport=False)

    def succeeded(self) -> None:
        if not self.closed:
            self.pool.succeeded(self.ep)
        self.close()

    def close(self) -> None:
        """Give the endpoint's share back: the ticket and the in-flight count (once)."""
        if self.closed:
            return
        self.closed = True
        self.pool.release(self.ticket)
        if self.relaying:
            self.state.metrics.series("in_flight", self.ep.url).dec()


@dataclass(slots=True)
class Sent:
    """An upstream response being relayed, and what routing decided and promised for it."""

    up: UpstreamResponse
    decision: Decision
    attempt: Attempt
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


class Routed(Protocol):
    """What settlement and the response headers read of a routed request: a ``Sent``, or
    the EPP's pick (``gateway.epp.pick.Picked``), which Envoy sends."""

    @property
    def decision(self) -> Decision: ...
    @property
    def attempt(self) -> Attempt: ...
    @property
    def prefill_used(self) -> bool: ...
    @property
    def ttft_origin(self) -> float: ...


def request_headers(ctx: RequestContext, a: Attempt) -> dict[str, str]:
    return {"Content-Type": "application/json", "X-Request-Id": ctx.request_id,
            **a.pool.auth_headers(a.ep), **a.trace_headers()}


@dataclass(slots=True)
class Answer:
    """An attempt's answer: its response, and for a 200 its stream's events (the first
    already read and checked)."""

    up: UpstreamResponse
    lines: AsyncIterator[bytes] | None = None


async def send(state: GatewayState, ctx: RequestContext, a: Attempt, body: bytes,
               t: Timeouts) -> Answer:
    """Send one attempt and wait for its stream's first event (within ``first_token_s``), so
    that an upstream that stalls, breaks or answers garbage before anything reached the
    client can still be retried elsewhere, invisibly to the client. (The upstream is always
    asked for a stream: ``dispatch.upstream_body``.)"""
    ep = a.ep
    path = "/chat/completions" if ctx.kind == "chat" else "/completions"

    async def first() -> Answer:
        up = await state.upstream.post(ep.url + path, body, request_headers(ctx, a),
                                       connect_timeout_s=t.connect_s, ca_file=ep.ca_file)
        if up.status != 200:
            return Answer(up)
        try:
            if not up.headers.get("content-type", "").lower().startswith("text/event-stream"):
                raise UpstreamProtocolError("the upstream's answer to a stream is not "
                                            "text/event-stream")
            lines = up.lines()
            got = await first_event(lines)
        except ErrorEvent as exc:
            up.release()
            raise judge_error_event(exc.error, ep, a.pool) from None
        except BaseException:
            up.release()
            raise
        return Answer(up, lines=_prepend(got, lines))

    async with asyncio.timeout(first_token_wait(t, a.predicted_ttft_s)):
        return await until_taken_out(ep, first(), lambda: a.pool.elsewhere(ep))


async def until_taken_out(ep: EndpointState, work: Awaitable[T],
                          elsewhere: Callable[[], bool]) -> T:
    """``work``, unless ``ep`` is taken out of rotation meanwhile (its scrapes, its probe or
    other requests failed: a hung or dead engine) and still out ``OUT_GRACE_S`` later (a busy
    engine whose scrapes time out once is back at its next good scrape) while ``elsewhere()``
    says another endpoint could take the request: then ``work`` is cancelled and this raises
    TimeoutError, a stall, retried there. With nowhere else to go the request waits on (a
    busy engine whose scrapes time out is slow, not always dead; the first-token timeout
    still bounds it). ``work`` runs in the caller's task; the endpoint's trip starts the
    check (no task or timer of its own per request)."""
    task = asyncio.current_task()
    assert task is not None
    loop = asyncio.get_running_loop()
    tripped = False

    def still_out() -> None:
        nonlocal tripped
        if (not tripped and not task.done() and not ep.healthy(time.monotonic())
                and elsewhere()):
            tripped = True
            task.cancel()

    def taken_out() -> None:
        loop.call_later(OUT_GRACE_S, still_out)

    ep.health.on_trip.add(taken_out)
    try:
        return await work
    except asyncio.CancelledError:
        if tripped and task.uncancel() == 0:
            log.warning("endpoint %s was taken out while a request waited for its first "
                        "token: retrying elsewhere", ep.url)
            raise TimeoutError from None
        raise
    finally:
        ep.health.on_trip.discard(taken_out)
        tripped = True  # a check still pending finds the work over


class ErrorEvent(Exception):
    """A stream whose first event is an error: the engine refused the request after its
    200 (vLLM validates some parameters only once streaming), judged like an error answer
    with the status the event names (``code``), else 502 (``judge_error_event``)."""

    def __init__(self, error: dict[str, Any]) -> None:
        super().__init__("the upstream's stream began with an error")
        self.error = error


async def first_event(lines: AsyncIterator[bytes]) -> list[bytes]:
    """The lines of a stream's first event, checked to be a JSON object that is not an
    error (else ``UpstreamProtocolError``)."""
    got: list[bytes] = []
    data = b""
    async for line in lines:
        got.append(line)
        if line not in (b"\n", b"\r\n"):
            data += line
            continue
        if not data:
            continue
        payload = event_payload(data)
        if payload:
            try:
                parse_event(payload)
            except BadEvent as exc:
                if exc.error is not None:
                    raise ErrorEvent(exc.error) from None
                raise UpstreamProtocolError(str(exc)) from None
        return got
    raise UpstreamBroken("the upstream ended the stream before any event")


async def _prepend(first: list[bytes], rest: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    for line in first:
        yield line
    async for line in rest:
        yield line


T = TypeVar("T")


async def retry(state: GatewayState, ctx: RequestContext, router: Router,
                info: RequestInfo | None, first: Decision | None, tried: list[EndpointState],
                try_one: Callable[[Decision, int], Awaitable[T]], last: APIError,
                model: str) -> T | APIError:
    """The one retry loop: ``try_one`` on ``first``, then on a new decision without every
    endpoint tried so far, while ``try_one`` raises a ``Failure`` that is the endpoint's
    fault and the retry policy (attempts, backoff, budget) allows another; what the first
    success returns, else the last error (``last`` when nothing could be tried)."""
    retrier = Retrier(ctx.view.policy.settings.retries, router.pool.budget, state.rng)
    retrier.first()
    decision, backoff, n = first, False, 0
    while decision is not None:
        if n and not await retrier.again(backoff):
            state.metrics.series("retries", model, "denied").inc()
            break
        if n:
            state.metrics.series("retries", model, "made").inc()
        n += 1
        ep = decision.endpoint.ep
        tried.append(ep)
        try:
            return await try_one(decision, n)
        except Failure as f:
            if not f.endpoint_fault:
                return f.error  # the request's own fault: another endpoint would refuse it
            last, backoff = f.error, f.backoff
            log.warning("endpoint %s failed (%s); retrying elsewhere if allowed", ep.url,
                        f.kind)
        decision = router.decide(info, tried) if info is not None else None
    return last


async def attempt_on(state: GatewayState, ctx: RequestContext, a: Attempt, body: bytes
                     ) -> Answer:
    """Send ``a`` and wait for its first event; a failure is judged on ``a`` (which is
    closed) and raised as a ``Failure``; cancelled, ``a`` is closed."""
    async def streamed() -> Answer:
        ans = await send(state, ctx, a, body, ctx.route.timeouts)
        if ans.up.status != 200 or ans.lines is None:
            raise await answer_failure(ans.up, a.ep, a.pool)
        return ans

    return await judged(a, streamed())


async def judged(a: Attempt, work: Awaitable[T]) -> T:
    """``work`` (an exchange with ``a``'s endpoint), its failures judged on ``a`` (which is
    then closed) and raised as a ``Failure``: a timeout or an upstream error as
    ``upstream_failure`` says, a ``Failure`` as it is; cancelled, ``a`` is closed."""
    try:
        try:
            return await work
        except (UpstreamError, TimeoutError) as exc:
            raise upstream_failure(exc) from exc
    except Failure as f:
        a.failed(f)
        raise
    except BaseException:
        a.close()
        raise


async def continue_stream(state: GatewayState, ctx: RequestContext, adm: quota.Admission,
                          sent: Sent, live: Live, generated: int) -> Sent | None:
    """Continue a stream cut off a draining endpoint on another one (``gateway.request.migrate``),
    under the same retry loop as first attempts."""
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
    info = sent.info
    tokens = (info.prompt_tokens if info else 0) + adm.expected_output

    async def try_one(decision: Decision, n: int) -> Sent:
        a = Attempt(state, ctx, pool, decision.endpoint.ep, tokens,
                    tokens - adm.expected_output + generated)
        ans = await attempt_on(state, ctx, a, raw)
        a.first_token()  # the first event was awaited: the prompt is in
        return Sent(ans.up, decision, a, time.perf_counter(), False, ans.lines, info)

    moved = await retry(state, ctx, router, info,
                        router.decide(info, [old]) if info is not None else None, [old],
                        try_one, APIError(502, "no endpoint to move to"), m.name)
    if isinstance(moved, APIError):
        log.warning("migration of %s failed: %s", ctx.request_id, moved.message)
        state.metrics.series("migrations", m.name, "failed").inc()
        return None
    state.metrics.series("migrations", m.name, "moved").inc()
    log.info("moved stream %s from %s to %s after %d tokens", ctx.request_id, old.url,
             moved.decision.endpoint.ep.url, generated)
    return moved
