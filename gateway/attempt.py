"""Sending a request to one endpoint: an attempt (and, for a stream, waiting for its first
event, so a failure before it can still be retried elsewhere), how its failures and non-200
answers are classified for the retry loop (``gateway.dispatch``), and continuing a stream on
another endpoint when its own is drained (``gateway.migrate``).

An upstream's error answer never reaches the client as it came: its body is read (capped),
logged, and replaced by our OpenAI-shaped error with a safe message and a mapped status."""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Protocol

import orjson

from gateway import migrate, quota
from gateway.config.resilience import Timeouts
from gateway.context import RequestContext
from gateway.endpoints import EndpointPool, EndpointState, Ticket
from gateway.migrate import Live
from gateway.relay import BadEvent, event_payload, parse_event
from gateway.retry import Retrier
from gateway.routing.plugins import RequestInfo
from gateway.routing.router import Decision
from gateway.state import GatewayState
from gateway.upstream import (
    UpstreamBroken,
    UpstreamError,
    UpstreamProtocolError,
    UpstreamResponse,
)
from protocol.errors import APIError

log = logging.getLogger("tokengate.gateway")
RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})
_CLIENT_STATUSES = frozenset({400, 413, 422})  # the request's content was refused
_MESSAGE_LIMIT = 400
_IDENT = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
ERROR_BODY_LIMIT = 64 * 1024  # what is read of an error answer


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


class Routed(Protocol):
    """What settlement and the response headers read of a routed request: a ``Sent``, or
    the EPP's pick (``gateway.epp.pick.Picked``), which Envoy sends."""

    @property
    def decision(self) -> Decision: ...
    @property
    def pool(self) -> EndpointPool: ...
    @property
    def ticket(self) -> Ticket: ...
    @property
    def prefill_used(self) -> bool: ...
    @property
    def ttft_origin(self) -> float: ...


def request_headers(ctx: RequestContext, pool: EndpointPool, ep: EndpointState
                    ) -> dict[str, str]:
    headers = {"Content-Type": "application/json", "X-Request-Id": ctx.request_id,
               **pool.auth_headers(ep)}
    if ctx.trace is not None and ctx.trace.upstream is not None:
        headers.update(ctx.trace.headers(ctx.trace.upstream))  # the engine's spans join
    return headers


@dataclass(slots=True)
class Answer:
    """An attempt's answer: its response, and for a 200 its stream's events (the first
    already read and checked)."""

    up: UpstreamResponse
    lines: AsyncIterator[bytes] | None = None


async def attempt(state: GatewayState, ctx: RequestContext, pool: EndpointPool,
                  ep: EndpointState, url: str, body: bytes, t: Timeouts) -> Answer:
    """Send one attempt and wait for its stream's first event (within ``first_token_s``), so
    that an upstream that stalls, breaks or answers garbage before anything reached the
    client can still be retried elsewhere, invisibly to the client. (The upstream is always
    asked for a stream: ``dispatch.upstream_body``.)"""
    async with asyncio.timeout(t.first_token_s):
        up = await state.upstream.post(url, body, request_headers(ctx, pool, ep),
                                       connect_timeout_s=t.connect_s, ca_file=ep.ca_file)
        if up.status != 200:
            return Answer(up)
        try:
            if not up.headers.get("content-type", "").lower().startswith("text/event-stream"):
                raise UpstreamProtocolError("the upstream's answer to a stream is not "
                                            "text/event-stream")
            lines = up.lines()
            first = await first_event(lines)
        except ErrorEvent as exc:
            up.release()
            raise judge_error_event(exc.error, ep, pool) from None
        except BaseException:
            up.release()
            raise
    return Answer(up, lines=_prepend(first, lines))


class ErrorEvent(Exception):
    """A stream whose first event is an error: the engine refused the request after its
    200 (vLLM validates some parameters only once streaming), judged like an error answer
    with the status the event names (``code``), else 502 (``judge_error_event``)."""

    def __init__(self, error: dict[str, Any]) -> None:
        super().__init__("the upstream's stream began with an error")
        self.error = error


def judge_error_event(error: dict[str, Any], ep: EndpointState, pool: EndpointPool
                      ) -> Failure:
    """An error event that came before any token, judged as an answer with its status."""
    code = error.get("code")
    status = code if isinstance(code, int) and 400 <= code < 600 else 502
    return judge_failure(status, None, orjson.dumps({"error": error}), ep, pool)


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


class Failure(Exception):
    """One attempt failed in a way another endpoint may not: retry (``backoff`` says whether
    to pause first: overload answers and stalls, not refused connections).
    ``endpoint_fault`` is False for answers another endpoint would give too (the request
    itself was refused): those are not retried and leave the endpoint healthy."""

    def __init__(self, error: APIError, kind: str, backoff: bool, *,
                 endpoint_fault: bool = True) -> None:
        super().__init__(error.message)
        self.error, self.kind, self.backoff = error, kind, backoff
        self.endpoint_fault = endpoint_fault


def upstream_failure(exc: BaseException) -> Failure:
    """A failed exchange (a timeout or one of ``gateway.upstream``'s errors) as a Failure."""
    if isinstance(exc, TimeoutError):
        return Failure(APIError(504, "the upstream did not send its first token in time",
                                type="server_error", code="upstream_timeout"), "timeout", True)
    kind = exc.kind if isinstance(exc, UpstreamError) else "broken"
    message = {"connect": "the upstream could not be reached",
               "protocol": "the upstream sent a malformed response"}.get(
                   kind, "the upstream closed the connection")
    if kind == "protocol":
        log.warning("malformed upstream response: %s", exc)
    return Failure(APIError(502, message, type="server_error", code="upstream_unavailable"),
                   kind, kind != "connect")


async def answer_failure(up: UpstreamResponse, ep: EndpointState, pool: EndpointPool
                         ) -> Failure:
    """A non-200 answer as a Failure: overload and server errors are retried elsewhere; the
    request's own faults (400, 413, 422) are not; anything else is the upstream's fault. The
    upstream's body goes to the log only; the client gets our message (with the upstream's
    ``code``/``param`` when they are plain identifiers)."""
    asked = up.headers.get("retry-after")
    try:
        body = await up.read(ERROR_BODY_LIMIT)
    except (UpstreamError, TimeoutError):
        body = b""
    finally:
        up.release()
    return judge_failure(up.status, asked, body, ep, pool)


def judge_failure(status: int, asked: str | None, body: bytes, ep: EndpointState,
                  pool: EndpointPool) -> Failure:
    """``answer_failure`` on an answer already read (``asked``: its ``retry-after``)."""
    body = body[:ERROR_BODY_LIMIT]
    log.warning("endpoint %s answered %d: %s", ep.url, status,
                body[:500].decode("utf-8", "replace"))
    if status in RETRY_STATUSES:
        if asked is not None:
            pool.overloaded(ep, asked)
        return Failure(APIError(502 if status >= 500 else 429,
                                f"the model server answered {status}", type="server_error",
                                code="upstream_error",
                                headers={"retry-after": _retry_after(asked)}),
                       str(status), True)
    code = param = None
    try:
        err = orjson.loads(body).get("error") if body else None
    except (orjson.JSONDecodeError, AttributeError):
        err = None
    message = ""
    if isinstance(err, dict):
        code = _ident(err.get("code"))
        param = _ident(err.get("param"))
        if isinstance(err.get("message"), str):
            message = err["message"][:_MESSAGE_LIMIT]
    if status in _CLIENT_STATUSES:
        # The upstream's message is read, never passed on (an upstream may echo a key or a
        # prompt back): the client gets the parameter it named and OpenAI's code. A numeric
        # "code" (vLLM repeats the status there) is no OpenAI code.
        if code is not None and code.isdigit():
            code = None
        if code is None and "context length" in message.lower():
            code = "context_length_exceeded"
        text = f"the model server rejected the request ({status})" + (
            f": invalid '{param}'" if param else "")
        return Failure(APIError(400, text, param=param, code=code or "upstream_rejected"),
                       str(status), False, endpoint_fault=False)
    return Failure(APIError(502, f"the model server answered {status}", type="server_error",
                            code="upstream_error"), str(status), True)


def _ident(v: object) -> str | None:
    if isinstance(v, int) and not isinstance(v, bool):
        v = str(v)
    return v if isinstance(v, str) and _IDENT.match(v) else None


def _retry_after(asked: str | None) -> str:
    try:
        return str(max(1, min(int(float(asked or "1")), 60)))
    except ValueError:
        return "1"


async def continue_stream(state: GatewayState, ctx: RequestContext, adm: quota.Admission,
                          sent: Sent, live: Live, generated: int) -> Sent | None:
    """Continue a stream cut off a draining endpoint on another one (``gateway.migrate``),
    under the same retry policy as first attempts."""
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
    retrier = Retrier(ctx.view.policy.settings.retries, pool.budget, state.rng)
    retrier.first()
    decision = router.decide(info, tried) if info is not None else None
    backoff = False
    while decision is not None:
        if len(tried) > 1 and not await retrier.again(backoff):
            break
        ep = decision.endpoint.ep
        tried.append(ep)
        tokens = (info.prompt_tokens if info else 0) + adm.expected_output
        ticket = pool.acquire(ep, tokens, tokens - adm.expected_output + generated)
        try:
            ans = await attempt(state, ctx, pool, ep, ep.url + path, raw,
                                ctx.route.timeouts)
            if ans.up.status != 200 or ans.lines is None:
                raise await answer_failure(ans.up, ep, pool)
        except (UpstreamError, TimeoutError, Failure) as exc:
            pool.release(ticket)
            f = exc if isinstance(exc, Failure) else upstream_failure(exc)
            log.warning("migration of %s to %s failed: %s", ctx.request_id, ep.url, f.kind)
            backoff = f.backoff
            decision = router.decide(info, tried) if info is not None else None
            continue
        except BaseException:
            pool.release(ticket)
            raise
        pool.first_token(ticket)  # attempt waited for its first event: the prompt is in
        state.metrics.series("migrations", m.name, "moved").inc()
        log.info("moved stream %s from %s to %s after %d tokens", ctx.request_id, old.url,
                 ep.url, generated)
        return Sent(ans.up, decision, pool, ticket, time.perf_counter(), False, ans.lines,
                    info)
    state.metrics.series("migrations", m.name, "failed").inc()
    return None
