"""How a failed attempt is judged: an exchange that broke or timed out, a non-200 answer, an
error event before any token. Each becomes a ``Failure`` saying whether another endpoint may
be tried, after a pause or not, and whether the endpoint is at fault.

An upstream's error answer never reaches the client as it came: its body is read (capped),
logged, and replaced by our OpenAI-shaped error with a safe message and a mapped status."""

from __future__ import annotations

import logging
import re
from typing import Any

import orjson

from gateway.log_throttle import UPSTREAM
from gateway.request.upstream import UpstreamConnectError, UpstreamError, UpstreamResponse
from gateway.routing.endpoints import EndpointPool, EndpointState
from protocol.errors import APIError

log = logging.getLogger("tokengate.gateway")
RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})
_CLIENT_STATUSES = frozenset({400, 413, 422})  # the request's content was refused
_MESSAGE_LIMIT = 400
_IDENT = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
ERROR_BODY_LIMIT = 64 * 1024  # what is read of an error answer

# Failure kinds that say the connection itself failed (the breaker counts them apart), and
# those after which the endpoint is probed at once.
TRANSPORT_KINDS = frozenset({"connect", "broken", "protocol"})
SUSPECT_KINDS = frozenset({"connect", "broken", "timeout", "protocol"})


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


def unreachable() -> Failure:
    """The endpoint could not be reached (a refused or failed connection)."""
    return upstream_failure(UpstreamConnectError("the endpoint could not be reached"))


def upstream_failure(exc: BaseException) -> Failure:
    """A failed exchange (a timeout or an ``upstream`` error) as a Failure."""
    if isinstance(exc, TimeoutError):
        return Failure(APIError(504, "the upstream did not send its first token in time",
                                type="server_error", code="upstream_timeout"), "timeout", True)
    kind = exc.kind if isinstance(exc, UpstreamError) else "broken"
    message = {"connect": "the upstream could not be reached",
               "protocol": "the upstream sent a malformed response"}.get(
                   kind, "the upstream closed the connection")
    if kind == "protocol":
        UPSTREAM.warning(log, "malformed", "malformed upstream response: %s", exc)
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
    UPSTREAM.warning(log, ("answered", ep.url, status), "endpoint %s answered %d: %s", ep.url,
                     status, body[:500].decode("utf-8", "replace"))
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
        if code is not None and code.isascii() and code.isdigit():
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


def judge_error_event(error: dict[str, Any], ep: EndpointState, pool: EndpointPool
                      ) -> Failure:
    """An error event that came before any token, judged as an answer with its status."""
    code = error.get("code")
    status = code if isinstance(code, int) and 400 <= code < 600 else 502
    return judge_failure(status, None, orjson.dumps({"error": error}), ep, pool)
