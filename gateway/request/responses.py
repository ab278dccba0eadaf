"""Answering a Responses API request (``POST /v1/responses``) that was served as a chat
completion (``protocol.responses``): the relayed chat stream becomes the Responses event
sequence as it is written (``EventSink``), a whole chat completion becomes a ``response``
object (``whole``). Everything before (counting, admission, routing, failover) and after
(settlement from the engine's usage) is the chat pipeline's."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import orjson

from gateway.request.relay import Sink, event_payload
from protocol.response_events import EventStream, Shape, completion_to_response


class EventSink:
    """A ``relay.Sink`` that writes the Responses events of the chat events it is given to
    ``out`` (the client's response). The relay writes whole SSE events; an error event (the
    stream broke) becomes ``response.failed``, ``[DONE]`` the closing events with the usage
    the engine sent, else ``fallback_usage()`` (the gateway's own count)."""

    def __init__(self, out: Sink, stream: EventStream,
                 fallback_usage: Callable[[], Mapping[str, Any]]) -> None:
        self.out = out
        self.stream = stream
        self.fallback_usage = fallback_usage

    async def write(self, data: bytes) -> None:
        events: list[bytes] = []
        for block in data.split(b"\n\n"):
            payload = event_payload(block.strip())
            if not payload:
                continue
            if payload == b"[DONE]":
                events += self.stream.done(self.fallback_usage())
                continue
            obj = orjson.loads(payload)
            if not isinstance(obj, dict):
                continue
            if "error" in obj:
                err = obj["error"] if isinstance(obj["error"], dict) else {}
                events += self.stream.failed(err)
            else:
                events += self.stream.chunk(obj)
        if events:
            await self.out.write(b"".join(events))


def whole(shape: Shape, completion: bytes) -> bytes:
    """The ``response`` object of a whole chat completion (as ``Aggregate`` built it)."""
    obj: dict[str, Any] = orjson.loads(completion)
    return orjson.dumps(completion_to_response(shape, obj))
