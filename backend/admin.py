"""Operator endpoints: state, the latest requests' times, convertible roles (TokenScale),
fault injection.

``POST /admin/role {"role": "prefill"|"decode"|"both", "wait": true, "timeout_s": 30}`` flips
the role at once for new requests (a converted decoder takes prefill work within milliseconds)
and, with ``wait``, answers when the work that depended on the old role has drained: for an
old prefill role, held KV blocks pulled or expired and prefills in flight done; for an old decode
role, handed-off decodes finished. The answer says whether it drained and how long it took.
"""

from __future__ import annotations

import asyncio
from dataclasses import asdict
from typing import Any, cast

import orjson
from aiohttp import web

from backend.config import ROLES, Role
from backend.state import STATE, BackendState
from protocol.bodies import json_object
from protocol.errors import bad


def _dumps(o: Any) -> str:
    return orjson.dumps(o).decode()


def pending_for_role(state: BackendState, role: Role) -> int:
    """In-flight work that needs ``role`` to keep being served."""
    reqs = state.engine.requests()
    if role == "prefill":
        return len(state.engine.held) + sum(1 for r in reqs if r.remote_decode)
    if role == "decode":
        return sum(1 for r in reqs if r.remote_prefill is not None)
    return 0


def snapshot(state: BackendState) -> dict[str, Any]:
    e = state.engine
    return {
        "engine_id": state.engine_id,
        "model": state.config.name,
        "model_profile": state.model.name,
        "hardware": state.hardware.name,
        "role": state.role,
        "ready": state.ready,
        "running": len(e.scheduler.running),
        "waiting": len(e.scheduler.waiting),
        "in_flight": e.num_in_flight(),
        "kv": {"num_gpu_blocks": e.pool.num_blocks, "block_size": e.config.block_size,
               "free_blocks": e.pool.num_free, "cached_blocks": e.pool.num_cached,
               "usage": e.pool.usage(), "held_requests": len(e.held),
               "held_blocks": sum(len(h.blocks) for h in e.held.values())},
        "prefix_cache": {"queries": e.kv.stats.queries, "hits": e.kv.stats.hits},
        "preemptions": e.scheduler.num_preemptions,
        "max_model_len": state.max_model_len,
        "time_scale": e.config.time_scale,
        "loop": {"steps": e.lag.steps, "mean_lag_s": e.lag.total_s / max(e.lag.steps, 1),
                 "max_lag_s": e.lag.max_s, "resyncs": e.lag.resyncs,
                 "busy_s": e.lag.busy_s},
        "draining": {r: pending_for_role(state, r) for r in ("prefill", "decode")
                     if r != state.role and state.role != "both"},
        "pooling": pooling(state),
        "lora": None if state.lora is None else {
            "max_loras": state.lora.config.max_loras, "loads": state.lora.loads,
            "adapters": {a.name: {"path": a.path, "rank": a.rank, "bytes": a.bytes}
                         for a in state.lora.adapters.values()}},
    }


def pooling(state: BackendState) -> dict[str, Any]:
    """The hosted models: residency, queues, what switching costs and has cost."""
    mux = state.engine.mux
    st = mux.stats
    return {
        "mode": mux.mode,
        "active": mux.active.name if mux.active is not None else None,
        "free_bytes": mux.free_bytes(),
        "switches": st.switches, "switch_s": st.switch_s, "turns": st.turns,
        "weight_evictions": st.weight_evictions, "kv_dropped_requests": st.kv_drops,
        "models": {s.name: {"profile": s.profile.name, "resident": s.resident,
                            "running": len(s.scheduler.running),
                            "waiting": len(s.scheduler.waiting),
                            "kv_blocks": s.used_blocks, "wait_s": mux.wait_seconds(s.name),
                            "switches": s.loads, "switch_s": s.load_s,
                            "max_model_len": state.max_len.get(s.name)}
                   for s in mux.slots},
    }


async def get_state(request: web.Request) -> web.Response:
    return web.json_response(snapshot(request.app[STATE]), dumps=_dumps)


async def get_requests(request: web.Request) -> web.Response:
    """The latest finished requests (up to ``metrics.RECENT``), each by its ``X-Request-Id``:
    when it reached the engine (``arrival``), was first scheduled in a step (``scheduled``: the
    engine's queue before, its prefill after), its first token left the engine
    (``first_token``) and it finished (``finished``), in seconds of the host's monotonic clock
    (``time.monotonic``, the same in every process of the host, and real seconds whatever
    ``--time-scale``), so a client on the host can tell its own time from the engine's."""
    recent = request.app[STATE].metrics.recent
    return web.json_response(
        {"clock": "monotonic", "requests": [
            {"id": rid, "arrival": arrival, "scheduled": scheduled, "first_token": first,
             "finished": done} for rid, arrival, scheduled, first, done in recent]},
        dumps=_dumps)


async def set_role(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = await json_object(request)
    role = body.get("role")
    if role not in ROLES:
        raise bad(f"'role' must be one of {list(ROLES)}", "role")
    wait = body.get("wait", True)
    timeout = body.get("timeout_s", 30.0)
    if not isinstance(wait, bool) or isinstance(timeout, bool) \
            or not isinstance(timeout, int | float) or timeout < 0:
        raise bad("'wait' must be a boolean and 'timeout_s' a non-negative number")
    old = state.role
    new = cast(Role, role)
    state.role = new
    loop = asyncio.get_running_loop()
    started = loop.time()
    drained = True
    if wait and old != new and old != "both":
        while pending_for_role(state, old):
            if loop.time() - started >= timeout:
                drained = False
                break
            await asyncio.sleep(0.005)
    return web.json_response({"role": new, "previous": old, "drained": drained,
                              "pending": pending_for_role(state, old) if old != new else 0,
                              "drain_s": loop.time() - started}, dumps=_dumps)


async def get_faults(request: web.Request) -> web.Response:
    return web.json_response(asdict(request.app[STATE].faults.config), dumps=_dumps)


async def set_faults(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = await json_object(request)
    try:
        state.faults.config = state.faults.config.updated(body)
    except ValueError as exc:
        raise bad(str(exc)) from None
    state.engine.extra_step_s = state.faults.config.slow_step_s
    return web.json_response(asdict(state.faults.config), dumps=_dumps)

