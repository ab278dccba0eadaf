"""The pieces of an OpenAI answer the generation endpoints build: SSE chunks (``Chunks``),
one text piece per token (``token_pieces``), the ``finish_reason`` of an engine status, and the
error event that ends a stream the engine failed (``failed``)."""

from __future__ import annotations

import time
from typing import Any

import orjson
from aiohttp import web

from backend.request import Status
from backend.state import BackendState
from backend.stream import Delta
from protocol.errors import APIError
from protocol.validate import Kind


def finish_reason(status: Status | None) -> str | None:
    if status is Status.FINISHED_STOPPED:
        return "stop"
    if status is Status.FINISHED_LENGTH:
        return "length"
    return None


class Chunks:
    """Builds the SSE chunks of one response."""

    def __init__(self, kind: Kind, rid: str, model: str) -> None:
        self.kind = kind
        chat = kind == "chat"
        self.id = ("chatcmpl-" if chat else "cmpl-") + rid
        self.object = "chat.completion.chunk" if chat else "text_completion"
        self.created = int(time.time())
        self.model = model

    def _frame(self, choices: list[dict[str, Any]], **extra: Any) -> bytes:
        body = {"id": self.id, "object": self.object, "created": self.created,
                "model": self.model, "choices": choices, **extra}
        return b"data: " + orjson.dumps(body) + b"\n\n"

    def text(self, text: str, finish: str | None = None, role: bool = False,
             index: int = 0) -> bytes:
        if self.kind == "chat":
            delta: dict[str, Any] = {"role": "assistant", "content": text} if role \
                else {"content": text}
            choice = {"index": index, "delta": delta, "logprobs": None,
                      "finish_reason": finish}
        else:
            choice = {"index": index, "text": text, "logprobs": None, "finish_reason": finish}
        return self._frame([choice])

    def final(self, usage: dict[str, Any] | None, **extra: Any) -> bytes:
        """The choice-less last chunk carrying ``usage`` and/or ``kv_transfer_params``."""
        if usage is not None:
            extra["usage"] = usage
        return self._frame([], **extra)


async def failed(resp: web.StreamResponse, error: str) -> web.StreamResponse:
    """The engine failed mid-stream: its error event, then the end."""
    err = APIError(500, error, type="server_error", code="engine_failed")
    await resp.write(b"data: " + err.body() + b"\n\n")
    await resp.write_eof()
    return resp


def token_pieces(state: BackendState, d: Delta, stop: bool) -> list[str]:
    """One text piece per token (one SSE chunk each), or the whole delta after a stop cut."""
    if stop or len(d.token_ids) <= 1:
        return [d.text] if (d.text or d.token_ids) else []
    return [state.tokenizer.word_text(t) for t in d.token_ids]
