"""Prefill/decode disaggregation: the KV handoff between two instances (NixlConnector-style).

The proxy-facing half lives in the OpenAI handlers (``kv_transfer_params`` in and out). This
module is the instance-to-instance half, over HTTP on loopback standing in for RDMA:

* the decode instance ``POST``s ``/kv/pull`` to the prefill instance named in the params; the
  prefill instance checks that it holds those blocks (engine id, request id, block ids) and
  answers with the prompt length and the hash of its last full block, so the decode side can
  verify it is pulling the same prompt;
* the decode side then waits the modelled transfer time, ``latency + bytes / link bandwidth``
  (bytes = uncached prompt tokens × KV bytes per token: tokens it already caches are not pulled),
  scaled by ``--time-scale``;
* finally it ``POST``s ``/kv/release`` so the prefill instance frees the blocks (it frees them
  anyway after ``kv_hold_timeout_s``).

Any failure makes the decode instance recompute the prompt itself (vLLM's ``recompute`` policy).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import aiohttp
from aiohttp import web

from backend.request import Request
from backend.state import STATE, BackendState
from protocol.bodies import json_object
from protocol.errors import APIError, bad

log = logging.getLogger("tokengate.backend")
_TIMEOUT = aiohttp.ClientTimeout(total=10)


async def _held_call(request: web.Request) -> tuple[BackendState, str, dict[str, Any]]:
    """Validate a pull/release call addressed to this engine; return its request id."""
    state = request.app[STATE]
    body = await json_object(request)
    if body.get("engine_id") != state.engine_id:
        raise APIError(404, "unknown engine id", code="kv_not_found")
    rid = body.get("request_id")
    if not isinstance(rid, str):
        raise bad("request_id (string) is required")
    return state, rid, body


async def pull(request: web.Request) -> web.Response:
    state, rid, body = await _held_call(request)
    block_ids = body.get("block_ids")
    if not isinstance(block_ids, list) or not all(isinstance(b, int) for b in block_ids):
        raise bad("block_ids (array of integers) is required")
    held = state.engine.pull_held(rid, block_ids)
    if held is None:
        raise APIError(404, f"no KV held for request {rid}", code="kv_not_found")
    return web.json_response({"num_tokens": held.num_tokens,
                              "last_block_hash": held.last_block_hash,
                              "block_size": state.engine.config.block_size})


async def release(request: web.Request) -> web.Response:
    state, rid, _ = await _held_call(request)
    return web.json_response({"released": state.engine.release_held(rid)})


class KVPuller:
    """Decode side: pulls a prompt's KV from the prefill instance named in the params."""

    def __init__(self, state: BackendState) -> None:
        self._state = state

    async def __call__(self, req: Request) -> bool:
        state = self._state
        rp = req.remote_prefill
        assert rp is not None
        p = rp.params
        base = f"http://{p['remote_host']}:{p['remote_port']}"
        ident = {"engine_id": p["remote_engine_id"], "request_id": p["remote_request_id"]}
        session = state.http
        if session is None:
            return False
        started = state.engine.clock()
        try:
            async with session.post(f"{base}/kv/pull", json={
                    **ident, "block_ids": p["remote_block_ids"]}, timeout=_TIMEOUT) as r:
                if r.status != 200:
                    log.warning("KV pull for %s refused (%d): recomputing", req.request_id,
                                r.status)
                    state.metrics.kv_transfer_failures.inc()
                    return False
                info = await r.json()
        except (aiohttp.ClientError, TimeoutError) as exc:
            log.warning("KV pull for %s failed (%s): recomputing", req.request_id, exc)
            state.metrics.kv_transfer_failures.inc()
            return False
        if not self._same_prompt(req, info):
            log.warning("KV pull for %s: prefill holds a different prompt; recomputing",
                        req.request_id)
            state.metrics.kv_transfer_failures.inc()
            await self._release(base, ident)
            return False
        tokens = req.num_prompt_tokens - rp.hit_tokens
        nbytes = tokens * state.model.kv_bytes_per_token
        link = state.config.kv_link_latency_s + nbytes * 8 / state.config.kv_link_bps
        await asyncio.sleep(link * state.config.engine.time_scale)
        rp.pulled_tokens = tokens
        state.metrics.kv_transfer.observe(state.engine.clock() - started)
        state.metrics.kv_transfer_tokens.inc(tokens)
        await self._release(base, ident)
        return True

    def _same_prompt(self, req: Request, info: dict[str, object]) -> bool:
        if info.get("num_tokens") != req.num_prompt_tokens:
            return False
        bs = self._state.engine.config.block_size
        full = req.num_prompt_tokens // bs
        if not full:
            return True
        self._state.engine.kv.update_hashes(req)
        return info.get("last_block_hash") == req.block_hashes[full - 1]

    async def _release(self, base: str, ident: dict[str, object]) -> None:
        session = self._state.http
        if session is None:
            return
        try:
            async with session.post(f"{base}/kv/release", json=ident, timeout=_TIMEOUT) as r:
                await r.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            log.warning("KV release at %s failed (%s); it will time out there", base, exc)
