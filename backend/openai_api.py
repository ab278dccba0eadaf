"""The OpenAI-compatible generation endpoints: request → engine → JSON or SSE.

Streaming follows vLLM: response headers go out at once, the first chunk (``role``) comes with
the first token, then one chunk per token as steps produce them, a final chunk with the
``finish_reason``, an optional ``usage`` chunk (``stream_options.include_usage``), and
``data: [DONE]``. The request is aborted in the engine whenever the handler ends early (client
disconnect cancels the handler), which frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import random
import uuid
from typing import Any

import orjson
from aiohttp import web

from backend.choices import parallel
from backend.config import peer_allowed
from backend.request import RemotePrefill, Request
from backend.sse import Chunks, failed, finish_reason, token_pieces
from backend.state import STATE, BackendState, base_of
from backend.stream import RequestStream
from backend.textgen import WordSource
from protocol.bodies import read_body
from protocol.errors import APIError, bad
from protocol.validate import GenerationRequest, Kind, parse

_LARGE_PROMPT_CHARS = 32_768  # tokenize longer prompts off the event loop
_REMOTE_FIELDS = ("remote_engine_id", "remote_request_id", "remote_block_ids", "remote_host",
                  "remote_port")


async def _prompt_ids(state: BackendState, g: GenerationRequest) -> list[int]:
    tok = state.tokenizer
    m = state.hosted.get(g.model, state.model)
    if g.prompt_ids is not None:
        return list(g.prompt_ids)
    size = len(g.prompt_text or "") + sum(len(x["content"]) for x in g.messages)

    def run() -> list[int]:
        if g.kind == "completion":
            return tok.encode(g.prompt_text or "")
        return tok.chat_ids(g.messages, tokens_per_message=m.tokens_per_message,
                            tokens_per_name=m.tokens_per_name,
                            reply_priming=m.reply_priming_tokens,
                            continue_final=g.continue_final)

    if size < _LARGE_PROMPT_CHARS:
        return run()
    return await asyncio.get_running_loop().run_in_executor(state.executor, run)


def _check_role(state: BackendState, g: GenerationRequest) -> tuple[bool, RemotePrefill | None]:
    kvp = g.kv_transfer_params
    if not kvp:
        return False, None
    if kvp.get("do_remote_decode"):
        if state.role == "decode":
            raise APIError(503, "this instance is in the decode role; send prefill work elsewhere",
                           type="service_unavailable", code="wrong_role",
                           headers={"retry-after": "1"})
        return True, None
    if kvp.get("do_remote_prefill"):
        if state.role == "prefill":
            raise APIError(503, "this instance is in the prefill role; send decode work elsewhere",
                           type="service_unavailable", code="wrong_role",
                           headers={"retry-after": "1"})
        missing = [f for f in _REMOTE_FIELDS if kvp.get(f) is None]
        if missing:
            raise bad(f"kv_transfer_params is missing {', '.join(missing)}",
                      "kv_transfer_params")
        if not peer_allowed(kvp["remote_host"], kvp["remote_port"], state.config.kv_peers):
            state.metrics.kv_transfer_failures.inc()
            raise APIError(400, "kv_transfer_params names a prefill peer this instance does "
                           "not trust (see --kv-peer)", param="kv_transfer_params",
                           code="kv_peer_not_allowed")
        return False, RemotePrefill(dict(kvp))
    return False, None


def _new_request(state: BackendState, g: GenerationRequest, ids: list[int],
                 http_request: web.Request) -> tuple[Request, random.Random]:
    n = len(ids)
    limit = state.max_len.get(g.model, state.max_model_len)
    if n >= limit:
        raise bad(f"This model's maximum context length is {limit} tokens. However, your "
                  f"prompt has {n} tokens. Please reduce the length of the prompt.",
                  "messages" if g.kind == "chat" else "prompt", "context_length_exceeded")
    max_tokens = g.max_tokens if g.max_tokens is not None else limit - n
    if n + max_tokens > limit:
        raise bad(f"This model's maximum context length is {limit} tokens. However, you "
                  f"requested {n + max_tokens} tokens ({n} in the "
                  f"{'messages' if g.kind == 'chat' else 'prompt'}, {max_tokens} in the "
                  f"completion). Please reduce the length of the messages or completion.",
                  "max_tokens", "context_length_exceeded")
    if g.priority and state.config.engine.scheduling_policy != "priority":
        raise bad(f"Got priority {g.priority} but Priority scheduling is not enabled.",
                  "priority", "invalid_value")
    remote_decode, remote_prefill = _check_role(state, g)
    state.counter += 1
    seed = g.seed if g.seed is not None else state.config.engine.seed * 1_000_003 + state.counter
    rng = random.Random(seed)
    if g.ignore_eos:
        target = max_tokens
    else:
        target = min(max(state.lengths.sample(rng), g.min_tokens), max_tokens)
    rid = http_request.headers.get("X-Request-Id") or uuid.uuid4().hex
    if state.engine.knows(rid):
        rid = f"{rid}-{state.counter}"
    req = Request(rid, ids, max_tokens, target, state.engine.clock(),
                  cache_salt=g.cache_salt, model=g.model,
                  lora=None if g.model in state.hosted else g.model, remote_decode=remote_decode,
                  remote_prefill=remote_prefill, priority=g.priority)
    return req, rng


def _usage(req: Request) -> dict[str, Any]:
    return {"prompt_tokens": req.num_prompt_tokens,
            "completion_tokens": req.num_output_tokens,
            "total_tokens": req.num_tokens,
            "prompt_tokens_details": {"cached_tokens": max(req.num_cached_tokens, 0)}}


def _kv_params(state: BackendState, req: Request, stream: RequestStream) -> dict[str, Any] | None:
    if not req.remote_decode or stream.kv_transfer_params is None:
        return None
    return {"do_remote_prefill": True, "do_remote_decode": False,
            "remote_engine_id": state.engine_id, "remote_request_id": req.request_id,
            "remote_block_ids": stream.kv_transfer_params["block_ids"],
            "remote_host": state.config.host, "remote_port": state.config.port,
            "tp_size": state.model.tensor_parallel}


def check_ready(state: BackendState) -> None:
    """503 while the engine has failed or the model is loading."""
    if state.engine.failed is not None:
        raise APIError(503, "the engine has failed; see the server log",
                       type="service_unavailable", code="engine_failed")
    if not state.ready:
        raise APIError(503, "the model is still loading", type="service_unavailable",
                       code="model_loading", headers={"retry-after": "1"})


async def generate(request: web.Request, kind: Kind) -> web.StreamResponse:
    state = request.app[STATE]
    check_ready(state)
    status = state.faults.error_status()
    if status is not None:
        raise APIError(status, "injected fault", type="rate_limit_exceeded" if status == 429
                       else "server_error", code="injected_fault")
    g = parse(kind, await read_body(request))
    if base_of(state, g.model) is None:
        raise APIError(404, f"The model `{g.model}` does not exist.", param="model",
                       code="model_not_found")
    ids = _with_images(state, g, await _prompt_ids(state, g))
    if g.n > 1:
        return await parallel(request, state, g,
                              lambda: _new_request(state, g, ids, request))
    req, rng = _new_request(state, g, ids, request)
    stream = RequestStream(stop=g.stop)
    stall = state.faults.stall_s()
    if stall:
        await asyncio.sleep(stall)
    state.engine.submit(req, stream, WordSource(state.tokenizer.output_words, rng))
    try:
        if g.stream:
            try:
                return await _stream(request, state, g, req, stream)
            except ConnectionResetError:  # the client went away mid-stream: nobody to answer
                raise asyncio.CancelledError from None
        return await _complete(state, g, req, stream)
    finally:
        if stream.finish is None:
            state.engine.abort(req.request_id)


async def _complete(state: BackendState, g: GenerationRequest, req: Request,
                    stream: RequestStream) -> web.Response:
    parts: list[str] = []
    while True:
        d = await stream.next()
        parts.append(d.text)
        if d.finish is not None:
            break
    if d.error is not None:
        raise APIError(500, d.error, type="server_error", code="engine_failed")
    text = "".join(parts)
    finish = finish_reason(d.finish)
    c = Chunks(g.kind, req.request_id, g.model)
    if g.kind == "chat":
        choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text},
                                  "logprobs": None, "finish_reason": finish}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        obj = "text_completion"
    body: dict[str, Any] = {"id": c.id, "object": obj, "created": c.created, "model": c.model,
                            "choices": [choice], "usage": _usage(req)}
    kvp = _kv_params(state, req, stream)
    if kvp is not None:
        body["kv_transfer_params"] = kvp
    return web.Response(body=orjson.dumps(body), content_type="application/json",
                        headers={"x-request-id": req.request_id})


async def _stream(request: web.Request, state: BackendState, g: GenerationRequest,
                  req: Request, stream: RequestStream) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                       "Cache-Control": "no-cache",
                                       "x-request-id": req.request_id})
    await resp.prepare(request)
    c = Chunks(g.kind, req.request_id, g.model)
    drop_after = state.faults.drop_after()
    sent = 0
    first = True
    while True:
        d = await stream.next()
        if d.error is not None:
            return await failed(resp, d.error)
        finish = finish_reason(d.finish)
        pieces = token_pieces(state, d, bool(g.stop))
        for i, piece in enumerate(pieces):
            if drop_after is not None and sent >= drop_after:
                _drop(request)
                return resp
            last = d.finish is not None and i == len(pieces) - 1
            await resp.write(c.text(piece, finish if last else None, role=first))
            first = False
            sent += 1
        if d.finish is not None:
            if not pieces:
                await resp.write(c.text("", finish, role=first))
            break
    kvp = _kv_params(state, req, stream)
    if g.include_usage or kvp is not None:
        extra = {"kv_transfer_params": kvp} if kvp is not None else {}
        await resp.write(c.final(_usage(req) if g.include_usage else None, **extra))
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


def _with_images(state: BackendState, g: GenerationRequest, ids: list[int]) -> list[int]:
    """The prompt with each image's tokens (``--image-tokens``, as a vision encoder's
    placeholders); images are refused without it, and fetched from nowhere: data URLs only."""
    images = g.images
    if not images.count:
        return ids
    if not state.config.image_tokens:
        raise bad(f"the model `{g.model}` does not accept images", images.first,
                  "image_not_supported")
    if images.remote is not None:
        raise bad("this server takes images as base64 data URLs only", images.remote,
                  "image_url_not_allowed")
    pad = state.tokenizer.output_words[0]
    return ids + [pad] * (images.count * state.config.image_tokens)


def _drop(request: web.Request) -> None:
    """Fault: cut the connection mid-stream, as a crashed server would."""
    transport = request.transport
    if transport is not None:
        transport.abort()
    raise asyncio.CancelledError


async def models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    cards = [{"id": name, "object": "model", "created": 0, "owned_by": "tokengate",
              "root": profile.name, "parent": None, "max_model_len": state.max_len[name]}
             for name, profile in state.hosted.items()]
    if state.lora is not None:
        base = next(iter(state.hosted))
        cards += [{"id": a.name, "object": "model", "created": 0, "owned_by": "tokengate",
                   "root": a.path, "parent": base, "max_model_len": state.max_len[base]}
                  for a in state.lora.adapters.values()]
    return web.json_response({"object": "list", "data": cards}, dumps=lambda o: orjson.dumps(
        o).decode())
