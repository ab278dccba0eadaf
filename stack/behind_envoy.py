"""``tokengate up --envoy``: the demo stack's front is a real Envoy on the gateway's port,
with tokengate as its EPP (ext_proc) in this process; clients see the same URL and key."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence

from gateway.config.policy import load_policy
from gateway.epp.envoy import Envoy, epp_front, policy_endpoints
from gateway.epp.server import EPPConfig, serve_epp
from protocol.loopback import free_port


async def behind_envoy(policy: str, host: str, port: int, redis_url: str | None, *,
                       ready: asyncio.Event, stop: asyncio.Event,
                       more_ports: Sequence[int] = ()) -> None:
    """Serve the EPP, then Envoy on ``host:port`` in front of it, and one more Envoy on each
    of ``more_ports`` (data-plane replicas sharing the one EPP, as a Gateway's replicas share
    their InferencePool's picker); ``ready`` once they are; on ``stop`` the Envoys stop first
    (no new requests), then the EPP drains."""
    cfg = EPPConfig(policy, "127.0.0.1", free_port(), free_port(), redis_url)
    epp_ready = asyncio.Event()
    task = asyncio.ensure_future(serve_epp(cfg, ready=epp_ready, stop=stop))
    await asyncio.wait([task, asyncio.ensure_future(epp_ready.wait())],
                       return_when=asyncio.FIRST_COMPLETED)
    if task.done():
        task.result()
    endpoints = policy_endpoints(load_policy(policy))
    envoys = []
    for listen in (port, *more_ports):
        admin = free_port()
        envoys.append(Envoy(epp_front(admin_port=admin, listen_host=host, listen_port=listen,
                                      epp_host=cfg.host, epp_port=cfg.port,
                                      endpoints=endpoints), admin))
    started: list[Envoy] = []
    try:
        for envoy in envoys:
            await asyncio.to_thread(envoy.start)
            started.append(envoy)
        ready.set()
        await stop.wait()
    finally:
        for envoy in started:
            await asyncio.to_thread(envoy.stop)
        stop.set()
        with contextlib.suppress(asyncio.CancelledError):
            await task
