"""OpenAI-shaped errors: one exception type, a body builder, and the middleware that turns
every failure of a handler into ``{"error": {"message", "type", "param", "code"}}`` with the
right status, never a stack trace. Shared by the gateway and the reference backend."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping

import orjson
from aiohttp import web

log = logging.getLogger("tokengate")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class APIError(Exception):
    """An error answered to the client in OpenAI's shape."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def body(self) -> bytes:
        return orjson.dumps({"error": {"message": self.message, "type": self.type,
                                       "param": self.param, "code": self.code}})


def bad(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def _error_response(exc: APIError) -> web.Response:
    headers = dict(exc.headers)
    close = headers.pop("Connection", "").lower() == "close"
    resp = web.Response(status=exc.status, body=exc.body(), content_type="application/json",
                        headers=headers)
    if close:  # e.g. a body that never fully arrived: the connection cannot be reused
        resp.force_close()
    return resp


@web.middleware
async def errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every failure leaves in OpenAI's error shape, never as a stack trace."""
    try:
        return await handler(request)
    except APIError as exc:
        return _error_response(exc)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        # Nothing of the request is echoed (a path or a method may carry what a client
        # should not see reflected: a key pasted in a URL).
        kinds = {404: ("not_found_error", "unknown request URL: check the path (e.g. "
                       "/v1/chat/completions)"),
                 405: ("invalid_request_error", "this URL does not take that method"),
                 413: ("invalid_request_error", "request body too large")}
        kind, message = kinds.get(exc.status, ("invalid_request_error", exc.reason))
        allow = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None
        return _error_response(APIError(exc.status, message, type=kind, headers=allow))
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception:
        log.exception("unhandled error on %s %s", request.method, request.path)
        return _error_response(APIError(500, "internal error", type="server_error"))
