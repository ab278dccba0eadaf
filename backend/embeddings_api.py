"""``POST /v1/embeddings``: each input is a prefill through the engine (scheduled, batched
with generation and cached like any prompt, so its latency is the roofline's), and its vector
is deterministic: unit-length, of the model profile's hidden size (or ``dimensions`` of it,
renormalised, as Matryoshka models truncate), drawn from a generator seeded by the input's
token ids, so the same input always gets the same vector on any instance."""

from __future__ import annotations

import asyncio
import hashlib
import random
import uuid

import numpy as np
import orjson
from aiohttp import web

from backend.openai_api import check_ready
from backend.request import Request
from backend.state import STATE, BackendState, base_of
from backend.stream import RequestStream
from backend.textgen import WordSource
from protocol.bodies import read_body
from protocol.embeddings import EmbeddingsRequest, encode_vector, parse_embeddings
from protocol.errors import APIError, bad
from protocol.validate import load_json


def vector(ids: list[int], hidden: int, dimensions: int | None) -> list[float]:
    seed = int.from_bytes(hashlib.blake2b(np.asarray(ids, dtype=np.int64).tobytes(),
                                          digest_size=8).digest(), "little")
    v = np.random.default_rng(seed).standard_normal(hidden)[:dimensions or hidden]
    out: list[float] = (v / np.linalg.norm(v)).astype(np.float32).tolist()
    return out


async def embeddings(request: web.Request) -> web.Response:
    state = request.app[STATE]
    check_ready(state)
    e = parse_embeddings(load_json(await read_body(request)))
    base = base_of(state, e.model)
    if base is None:
        raise APIError(404, f"The model `{e.model}` does not exist.", param="model",
                       code="model_not_found")
    profile = state.hosted[base]
    if e.dimensions is not None and e.dimensions > profile.hidden_size:
        raise bad(f"'dimensions' must be at most {profile.hidden_size} for this model",
                  "dimensions")
    limit = state.max_len.get(e.model, state.max_model_len)
    ids = [state.tokenizer.encode(x) if isinstance(x, str) else list(x) for x in e.inputs]
    for i, x in enumerate(ids):
        if len(x) >= limit:
            raise bad(f"This model's maximum context length is {limit} tokens. However, "
                      f"input[{i}] has {len(x)} tokens.", "input", "context_length_exceeded")
    rid = request.headers.get("X-Request-Id") or uuid.uuid4().hex
    await asyncio.gather(*(_prefill(state, e, f"{rid}-emb{i}", x) for i, x in enumerate(ids)))
    data = [{"object": "embedding", "index": i,
             "embedding": encode_vector(vector(x, profile.hidden_size, e.dimensions),
                                        e.encoding_format)} for i, x in enumerate(ids)]
    n = sum(len(x) for x in ids)
    return web.Response(body=orjson.dumps({
        "object": "list", "data": data, "model": e.model,
        "usage": {"prompt_tokens": n, "total_tokens": n}}), content_type="application/json",
        headers={"x-request-id": rid})


async def _prefill(state: BackendState, e: EmbeddingsRequest, rid: str, ids: list[int]) -> None:
    """Run ``ids`` through the engine: its prefill (the pooled forward pass) and nothing
    after; aborted if the client leaves."""
    if state.engine.knows(rid):
        rid = f"{rid}-{uuid.uuid4().hex[:8]}"
    req = Request(rid, ids, 1, 1, state.engine.clock(), model=e.model)
    stream = RequestStream()
    state.engine.submit(req, stream, WordSource(state.tokenizer.output_words, random.Random(0)))
    try:
        while True:
            d = await stream.next()
            if d.error is not None:
                raise APIError(500, d.error, type="server_error", code="engine_failed")
            if d.finish is not None:
                return
    finally:
        if stream.finish is None:
            state.engine.abort(rid)
