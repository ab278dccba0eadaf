"""Reading a request body the way both servers must: a ``Content-Encoding`` they do not decode
is a 415, a body that is not what its encoding says is a 400 (aiohttp's decoding errors are the
client's fault, never a 500), both in OpenAI's error shape."""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import ClientPayloadError, web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError

from protocol.errors import APIError, bad

DECODED_ENCODINGS = frozenset({"identity", "gzip", "x-gzip", "deflate"})


async def read_body(request: web.Request) -> bytes:
    encodings = [e.strip().lower() for e in
                 request.headers.get("Content-Encoding", "").split(",") if e.strip()]
    unknown = [e for e in encodings if e not in DECODED_ENCODINGS]
    if unknown:
        raise APIError(415, f"unsupported Content-Encoding {unknown[0]!r} (use gzip, deflate "
                       "or none)", code="unsupported_content_encoding",
                       headers={"Connection": "close"})
    try:
        return await request.read()
    except (HttpProcessingError, ClientPayloadError, RequestPayloadError):
        raise APIError(400, "the request body could not be read as its Content-Encoding "
                       "says", code="bad_content_encoding",
                       headers={"Connection": "close"}) from None


async def json_object(request: web.Request) -> dict[str, Any]:
    """The body of an admin or KV call as a JSON object (400 otherwise)."""
    try:
        body = orjson.loads(await read_body(request))
    except orjson.JSONDecodeError:
        raise bad("body must be JSON") from None
    if not isinstance(body, dict):
        raise bad("body must be a JSON object")
    return body
