"""``tokengate epp``: tokengate as the Endpoint Picker of the Gateway API Inference Extension,
behind Envoy's ext_proc filter.

One process, one event loop: the ext_proc gRPC service (``envoy.service.ext_proc.v3``) and
gRPC health checking (``grpc.health.v1``: the protocol's ``liveness`` and ``readiness``
services and the ext_proc service's own name) on ``--port``, and
``tokengate serve``'s own HTTP app on ``--http-port`` for ``/metrics``, ``/ready`` and
``/admin/*`` (and the OpenAI API itself, for clients that bypass the proxy). Both share one
gateway state: the policy (reloaded on SIGHUP), the rate store (Redis: replicas of the EPP
share quotas, predictor and prefix hints, the active-active setup GIE's EPP lacks), the
fleet's scrapes and KV events. SIGTERM/SIGINT: health turns NOT_SERVING, new requests get 503,
requests in flight may finish for up to ``drain_timeout_s``."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
from aiohttp import web
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from gateway.epp.exchange import Exchange
from gateway.epp.order import OutOfOrder
from gateway.epp.proto import ext_proc_pb2 as pb
from gateway.epp.service import SERVICE, handler
from gateway.front.process import ServeConfig, announce, drain, in_flight, make_state
from gateway.front.reload import PolicyWatcher
from gateway.front.routes import build_app
from gateway.state import GatewayState

log = logging.getLogger("tokengate.epp")

# The protocol's health services (v1.0.0): alive while the process answers; ready (and the
# ext_proc service serving) while it takes requests. Every replica is ready: they share
# their state through Redis (active-active), so none waits as a follower.
LIVENESS, READINESS = "liveness", "readiness"


class Processor:
    """One ext_proc stream per HTTP request Envoy proxies."""

    def __init__(self, state: GatewayState) -> None:
        self.state = state
        self.streams = 0  # open exchanges (draining waits for them)

    async def Process(self, requests: AsyncIterator[pb.ProcessingRequest],
                      context: grpc.aio.ServicerContext[pb.ProcessingRequest, pb.ProcessingResponse]
                      ) -> AsyncIterator[pb.ProcessingResponse]:
        ex = Exchange(self.state)
        self.streams += 1
        try:
            async for req in requests:
                try:
                    answers = await ex.on(req)
                except OutOfOrder as exc:
                    log.warning("closing an ext_proc stream: %s", exc)
                    self.state.metrics.epp_refused_streams.inc()
                    await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
                for resp in answers:
                    yield resp
                if ex.done:
                    break
        finally:
            self.streams -= 1
            ex.close()


async def _ready_when_discovered(state: GatewayState, checker: health.aio.HealthServicer
                                 ) -> None:
    await state.discoverer.until_ready()
    for name in ("", READINESS, SERVICE):
        await checker.set(name, health_pb2.HealthCheckResponse.SERVING)


@dataclass(slots=True)
class EPPConfig:
    policy: str
    host: str = "127.0.0.1"
    port: int = 9002  # GIE's EPP port
    http_port: int = 9090  # GIE's EPP metrics port
    redis_url: str | None = None
    drain_timeout_s: float = 30.0


def make_epp_state(cfg: EPPConfig) -> tuple[GatewayState, PolicyWatcher]:
    return make_state(ServeConfig(cfg.policy, cfg.host, cfg.http_port, cfg.redis_url))


async def serve_epp(cfg: EPPConfig, *, ready: asyncio.Event | None = None,
                    stop: asyncio.Event | None = None, handle_signals: bool = False,
                    prepared: tuple[GatewayState, PolicyWatcher] | None = None) -> None:
    """Serve until ``stop`` (or a signal), then drain; ``prepared`` comes from
    ``make_epp_state`` when the caller wants to look inside (tests)."""
    state, watcher = prepared or make_epp_state(cfg)
    runner = web.AppRunner(build_app(state, watcher), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, cfg.host, cfg.http_port)
    await site.start()
    if cfg.http_port == 0:
        cfg.http_port = runner.addresses[0][1]
    processor = Processor(state)
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    server.add_generic_rpc_handlers((handler(processor.Process),))
    checker = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(checker, server)
    bound = server.add_insecure_port(f"{cfg.host}:{cfg.port}")
    if bound == 0:
        raise OSError(f"cannot listen on {cfg.host}:{cfg.port}")
    cfg.port = bound
    await server.start()
    await checker.set(LIVENESS, health_pb2.HealthCheckResponse.SERVING)
    for name in ("", READINESS, SERVICE):  # ready once discovery has found the endpoints
        await checker.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    readying = asyncio.ensure_future(_ready_when_discovered(state, checker))
    log.info("EPP listening on %s:%d (ext_proc, health), HTTP on %d (policy %s, store %s)",
             cfg.host, cfg.port, cfg.http_port, cfg.policy, type(state.store).__name__)
    stop = announce(stop, watcher, handle_signals, ready)
    try:
        await stop.wait()
        readying.cancel()
        state.draining = True
        for name in ("", READINESS, SERVICE):  # alive while it drains, no longer ready
            await checker.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        await drain(cfg.drain_timeout_s, lambda: processor.streams > 0 or in_flight(state) > 0)
        log.info("drained (%d exchanges open); stopping", processor.streams)
    finally:
        await server.stop(grace=1.0)
        await runner.cleanup()
        state.tracer.shutdown()
