"""``n > 1``: several choices for one prompt, as vLLM serves them (``n`` requests in the
engine, answered as one response)."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from typing import Any

import orjson
from aiohttp import web

from backend.request import Request
from backend.sse import Chunks, failed, finish_reason, token_pieces
from backend.state import BackendState
from backend.stream import Delta, RequestStream
from backend.textgen import WordSource
from protocol.errors import APIError
from protocol.validate import GenerationRequest


async def parallel(request: web.Request, state: BackendState, g: GenerationRequest,
                   new: Callable[[], tuple[Request, random.Random]]) -> web.StreamResponse:
    """``n`` choices: ``n`` requests in the engine sharing the prompt (its blocks cached after
    the first), each with its own seed; answered as one response with a choice per index and
    the prompt counted once in ``usage``, as vLLM does."""
    reqs: list[Request] = []
    streams: list[RequestStream] = []
    for _ in range(g.n):  # each submitted before the next is named (its id must be new)
        req, rng = new()
        stream = RequestStream(stop=g.stop)
        state.engine.submit(req, stream, WordSource(state.tokenizer.output_words, rng))
        reqs.append(req)
        streams.append(stream)
    c = Chunks(g.kind, reqs[0].request_id, g.model)
    try:
        if not g.stream:
            outs = await asyncio.gather(*(_collect(s) for s in streams))
            choices = []
            for i, (text, finish) in enumerate(outs):
                choices.append({"index": i, "message": {"role": "assistant", "content": text},
                                "logprobs": None, "finish_reason": finish}
                               if g.kind == "chat" else
                               {"index": i, "text": text, "logprobs": None,
                                "finish_reason": finish})
            return web.Response(body=orjson.dumps({
                "id": c.id, "object": "chat.completion" if g.kind == "chat"
                else "text_completion", "created": c.created, "model": c.model,
                "choices": choices, "usage": _usage_n(reqs)}), content_type="application/json")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})
        await resp.prepare(request)
        queue: asyncio.Queue[tuple[int, Delta]] = asyncio.Queue()

        async def pump(i: int, s: RequestStream) -> None:
            while True:
                d = await s.next()
                await queue.put((i, d))
                if d.finish is not None or d.error is not None:
                    return

        tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
        try:
            left, first = len(streams), set(range(len(streams)))
            while left:
                i, d = await queue.get()
                if d.error is not None:
                    return await failed(resp, d.error)
                finish = finish_reason(d.finish)
                pieces = token_pieces(state, d, bool(g.stop)) or ([""] if d.finish else [])
                for j, piece in enumerate(pieces):
                    last = d.finish is not None and j == len(pieces) - 1
                    await resp.write(c.text(piece, finish if last else None,
                                            role=i in first, index=i))
                    first.discard(i)
                left -= d.finish is not None
        finally:
            for t in tasks:
                t.cancel()
        if g.include_usage:
            await resp.write(c.final(_usage_n(reqs)))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp
    finally:
        for req, s in zip(reqs, streams, strict=True):
            if s.finish is None:
                state.engine.abort(req.request_id)


async def _collect(stream: RequestStream) -> tuple[str, str | None]:
    parts: list[str] = []
    while True:
        d = await stream.next()
        if d.error is not None:
            raise APIError(500, d.error, type="server_error", code="engine_failed")
        parts.append(d.text)
        if d.finish is not None:
            return "".join(parts), finish_reason(d.finish)


def _usage_n(reqs: list[Request]) -> dict[str, Any]:
    prompt = reqs[0].num_prompt_tokens
    out = sum(r.num_output_tokens for r in reqs)
    return {"prompt_tokens": prompt, "completion_tokens": out, "total_tokens": prompt + out,
            "prompt_tokens_details": {"cached_tokens": max(reqs[0].num_cached_tokens, 0)}}
