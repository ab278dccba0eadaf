"""``tokengate up --envoy``: the demo stack's front is a real Envoy on the gateway's port,
with tokengate as its EPP (ext_proc) in this process; clients see the same URL and key."""

from __future__ import annotations

import asyncio
import contextlib

from gateway.config.policy import load_policy
from gateway.epp.envoy import Envoy, epp_front, policy_endpoints
from gateway.epp.server import EPPConfig, serve_epp
from protocol.loopback import free_port


async def behind_envoy(policy: str, host: str, port: int, redis_url: str | None, *,
                       ready: asyncio.Event, stop: asyncio.Event) -> None:
    """Serve the EPP, then Envoy on ``host:port`` in front of it; ``ready`` once Envoy is;
    on ``stop`` Envoy stops first (no new requests), then the EPP drains."""
    cfg = EPPConfig(policy, "127.0.0.1", free_port(), free_port(), redis_url)
    epp_ready = asyncio.Event()
    task = asyncio.ensure_future(serve_epp(cfg, ready=epp_ready, stop=stop))
    await asyncio.wait([task, asyncio.ensure_future(epp_ready.wait())],
                       return_when=asyncio.FIRST_COMPLETED)
    if task.done():
        task.result()
    admin = free_port()
    envoy = Envoy(epp_front(admin_port=admin, listen_host=host, listen_port=port,
                            epp_host=cfg.host, epp_port=cfg.port,
                            endpoints=policy_endpoints(load_policy(policy))), admin)
    try:
        await asyncio.to_thread(envoy.start)
        ready.set()
        await stop.wait()
    finally:
        await asyncio.to_thread(envoy.stop)
        stop.set()
        with contextlib.suppress(asyncio.CancelledError):
            await task
