"""Prefill/decode disaggregation, the proxy's half of vLLM's NixlConnector protocol.

The prefill endpoint gets the client's body with ``stream: false``, ``max_tokens: 1`` (and
``max_completion_tokens: 1`` if present), ``stream_options`` and ``min_tokens`` removed and
``kv_transfer_params.do_remote_decode``; its answer's ``kv_transfer_params`` go to the decode
endpoint with the original body (``dispatch.upstream_body``). Both calls carry the same
``X-Request-Id``. Any failure returns None: the decode endpoint then computes the prompt itself.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any
from urllib.parse import urlsplit

import orjson

from gateway.config.policy import Model
from gateway.config.resilience import Timeouts
from gateway.request.attempt import Attempt
from gateway.request.failure import Failure
from gateway.request.upstream import UpstreamError
from gateway.routing.endpoints import EndpointPool
from gateway.routing.router import Decision
from gateway.state import GatewayState
from protocol.errors import APIError

log = logging.getLogger("tokengate.gateway")
PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False,
                  "remote_engine_id": None, "remote_block_ids": None, "remote_host": None,
                  "remote_port": None}


def prefill_body(client_body: dict[str, Any], m: Model) -> bytes:
    """vLLM's disaggregated-prefill request: one token, not streamed, KV kept for decode."""
    body = dict(client_body)
    body["model"] = m.upstream_name
    body["stream"] = False
    body["max_tokens"] = 1
    if "max_completion_tokens" in body:
        body["max_completion_tokens"] = 1
    body.pop("stream_options", None)
    body.pop("min_tokens", None)
    body["kv_transfer_params"] = dict(PREFILL_PARAMS)
    return orjson.dumps(body)


async def remote_prefill(state: GatewayState, t: Timeouts, kind: str, request_id: str,
                         client_body: dict[str, Any], m: Model, pool: EndpointPool,
                         d: Decision, trace_headers: dict[str, str] | None = None
                         ) -> dict[str, Any] | None:
    """Prefill on ``d.prefill``; the ``kv_transfer_params`` for decode, or None (then the
    decode endpoint computes the prompt itself)."""
    assert d.prefill is not None
    ep = d.prefill.ep
    headers = {"Content-Type": "application/json", "X-Request-Id": request_id,
               **pool.auth_headers(ep), **(trace_headers or {})}
    path = "/chat/completions" if kind == "chat" else "/completions"
    a = Attempt(state, None, pool, ep, d.prefill.uncached_tokens, d.prefill.uncached_tokens)
    try:
        up = await asyncio.wait_for(
            state.upstream.post(ep.url + path, prefill_body(client_body, m), headers,
                                connect_timeout_s=t.connect_s, ca_file=ep.ca_file),
            t.first_token_s)
        try:
            data = await up.read()
        finally:
            up.release()
        params = orjson.loads(data).get("kv_transfer_params") if up.status == 200 else None
        if isinstance(params, dict):
            # The prompt is computed: the prefill endpoint's queue moves on (and its prefill
            # rate is learned) exactly as when an aggregated endpoint sends a first token.
            a.first_token()
    except (UpstreamError, TimeoutError, orjson.JSONDecodeError, AttributeError) as exc:
        log.warning("prefill on %s failed (%s); decoding alone", ep.url, exc)
        params = None
    except BaseException:
        a.close()
        raise
    if isinstance(params, dict) and not names_the_pool(params, pool):
        # the decode engine would pull KV from wherever these say: only from this pool
        log.warning("prefill on %s named %r as where its KV is, not an endpoint of %s: "
                    "decoding alone", ep.url, params.get("remote_host"), m.name)
        state.metrics.series("prefill_rejected", m.name).inc()
        params = None
    if not isinstance(params, dict):
        a.failed(Failure(APIError(502, "the prefill failed", type="server_error",
                                  code="upstream_error"), "prefill", False))
        return None
    a.succeeded()
    return params


def names_the_pool(params: dict[str, Any], pool: EndpointPool) -> bool:
    """Do a prefill's ``kv_transfer_params`` name a host of ``pool`` (or no host at all)?"""
    host = params.get("remote_host")
    if host is None:
        return True
    if not isinstance(host, str):
        return False
    hosts = {(urlsplit(e.url).hostname or "").lower() for e in pool.endpoints}
    return host.strip("[]").lower() in hosts
