"""The gateway's HTTP server: aiohttp's, hardened against misbehaving clients.

* Protocol errors that aiohttp answers itself, before any handler runs (header floods: more
  than ``max_headers`` headers or a line over ``max_field_size``; malformed request lines),
  leave in OpenAI's error shape instead of aiohttp's plain text, and never with a traceback.
* Slow senders: a request head (request line and headers) must arrive within
  ``header_timeout_s`` of its first byte (or of the connection opening); otherwise the
  connection gets a 408 in OpenAI's shape and is closed. A body must arrive within
  ``body_timeout_s`` (enforced where the body is read, ``read_body``). Idle keep-alive
  connections close after ``keepalive_s``.

aiohttp has no public hook for its protocol handler, so ``GatewayRunner`` swaps the class of
the server it builds for one that makes ``GuardedHandler`` instances; everything else is
aiohttp's own.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import orjson
from aiohttp import http_exceptions, web
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest
from aiohttp.web_server import Server

from protocol import bodies
from protocol.errors import APIError

log = logging.getLogger("tokengate.gateway")
SERVER = "tokengate"  # the Server header of every response (never Python/aiohttp's)


def _fault(exc: BaseException | None) -> str:
    """What kind of protocol fault ``exc`` is, in words that quote nothing of the request."""
    if isinstance(exc, http_exceptions.LineTooLong):
        return "a request line or header field is too long"
    if isinstance(exc, (http_exceptions.BadStatusLine, http_exceptions.BadHttpMethod)):
        return "the request line is invalid"
    if isinstance(exc, http_exceptions.InvalidHeader):
        return "a header field is invalid"
    if isinstance(exc, (http_exceptions.TransferEncodingError,
                        http_exceptions.ContentLengthError)):
        return "the body's framing is invalid"
    return "the request does not parse as HTTP/1.1"


def _raw_error(status: int, reason: str, message: str, code: str) -> bytes:
    body = orjson.dumps({"error": {"message": message, "type": "invalid_request_error",
                                   "param": None, "code": code}})
    return (f"HTTP/1.1 {status} {reason}\r\nServer: {SERVER}\r\nContent-Type: application/json"
            f"\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode() + body


class GuardedHandler(RequestHandler):
    header_timeout_s = 10.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_timer: asyncio.TimerHandle | None = None
        self._in_request = False
        self.timed_out = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        if not self._in_request:
            self._arm()
        super().data_received(data)

    def connection_lost(self, exc: BaseException | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        if self._head_timer is None:
            self._head_timer = asyncio.get_running_loop().call_later(
                self.header_timeout_s, self._head_timeout)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def request_started(self) -> None:
        """A complete head arrived and a handler runs: the head deadline is met."""
        self._disarm()
        self._in_request = True

    def request_finished(self) -> None:
        self._in_request = False

    def _head_timeout(self) -> None:
        self._head_timer = None
        transport = self.transport
        if self._in_request or transport is None or transport.is_closing():
            return
        self.timed_out += 1
        transport.write(_raw_error(408, "Request Timeout", "the request head was not received "
                                   f"within {self.header_timeout_s:g} s", "request_timeout"))
        transport.close()

    def handle_error(self, request: BaseRequest, status: int = 500,
                     exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        if request.writer.output_size > 0:
            # Part of a response went out already (a stream whose client left): another
            # response cannot follow it on this connection; aiohttp closes it.
            raise ConnectionError("response already started; cannot send an error after it")
        if status >= 500:
            if isinstance(exc, ConnectionResetError):  # the client left before the answer
                log.debug("client connection reset before the response")
            else:
                log.warning("error outside the handlers: %s",
                            type(exc).__name__ if exc else status)
            err = APIError(status, "internal error", type="server_error")
        else:
            # The parser's own message quotes the offending bytes (a header line, maybe an
            # Authorization): the client gets what kind of fault it was, nothing it sent.
            err = APIError(status, f"malformed HTTP request: {_fault(exc)}",
                           code="bad_http_request")
        resp = web.Response(status=err.status, body=err.body(), content_type="application/json",
                            headers={"Server": SERVER})
        resp.force_close()
        return resp


class _GuardedServer(Server):
    def __call__(self) -> RequestHandler:
        return GuardedHandler(self, loop=self._loop, **self._kwargs)


class GatewayRunner(web.AppRunner):
    async def _make_server(self) -> Server:
        server = await super()._make_server()
        server.__class__ = _GuardedServer
        return server


@web.middleware
async def guard(request: web.Request, handler: Any) -> web.StreamResponse:
    """Tell the connection's handler that a request head arrived, and when it is done."""
    proto = request.protocol
    if isinstance(proto, GuardedHandler):
        proto.request_started()
        try:
            return await handler(request)  # type: ignore[no-any-return]
        finally:
            proto.request_finished()
    return await handler(request)  # type: ignore[no-any-return]


async def read_body(request: web.Request, timeout_s: float) -> bytes:
    """The request body (``protocol.bodies``), or a 408 when the client sends it slower than
    ``timeout_s``."""
    try:
        async with asyncio.timeout(timeout_s):
            return await bodies.read_body(request)
    except TimeoutError:
        raise APIError(408, f"the request body was not received within {timeout_s:g} s",
                       code="request_timeout", headers={"Connection": "close"}) from None
