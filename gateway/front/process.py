"""``tokengate serve``: one gateway process (several with ``--workers``, sharing a port).

Signals: SIGHUP reloads the policy; SIGTERM/SIGINT drain — new requests get 503 with
``retry-after`` and ``/ready`` turns false, streams in flight may finish for up to
``drain_timeout_s``, then the process exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web

from gateway.config.policy import load_policy
from gateway.front.http_guard import GatewayRunner, GuardedHandler
from gateway.front.reload import PolicyWatcher
from gateway.front.routes import build_app
from gateway.metrics import GatewayMetrics
from gateway.quota.limiter.lease import LeasedStore
from gateway.quota.limiter.memory import MemoryStore
from gateway.quota.limiter.redis_store import RedisStore
from gateway.quota.limiter.resilient import ResilientStore
from gateway.quota.limiter.store import RateStore
from gateway.routing.fleet import Fleet
from gateway.scaling.autoscaler import PoolScaler
from gateway.scaling.launcher import LocalLauncher
from gateway.state import GatewayState, Tokenizers, build_view, sync_tracer, tokenize_pool
from predictor.online import OnlinePredictor
from protocol import native
from protocol.runtime import freeze_startup_heap

# Prefix-index blocks recorded per event-loop step (~240 µs against an index of 100,000 blocks).
# Smaller steps cost more in all: each step's eviction walks the dict's head past the slots
# freed before it (256 took a cold 100K-token prompt's routing from 3.5 to 5.8 ms of CPU).
RECORD_STEP_BLOCKS = 1_024
# Python's default is 5 ms: the counting threads (``gateway.counting.slots``) then hold the event
# loop back up to 5 ms each time it wakes while they run; with 1 ms the light tenant's p99 under
# ten 3 MB requests was lower in each of four alternated pairs (benchmarks/stall.py).
GIL_SWITCH_S = 0.001

log = logging.getLogger("tokengate.gateway")


@dataclass(slots=True)
class ServeConfig:
    policy: str
    host: str = "127.0.0.1"
    port: int = 8080
    redis_url: str | None = None
    reuse_port: bool = False
    drain_timeout_s: float = 30.0
    seed: int = 0
    predictor_path: str | None = None  # load the predictor from here at start, save at stop
    log_dir: str | None = None  # where launched backends log (scaling pools)
    flow_mode: str | None = None  # --flow-control: overrides the policy's mode


def make_state(cfg: ServeConfig) -> tuple[GatewayState, PolicyWatcher]:
    policy = load_policy(cfg.policy)
    store: RateStore
    if cfg.redis_url:
        shared: RateStore = RedisStore.from_url(cfg.redis_url)
        if policy.settings.quota_lease > 0:
            shared = LeasedStore(shared, policy.settings.quota_lease)
        store = ResilientStore(shared,
                               fail_open=policy.settings.redis_failure == "fail_open",
                               replicas=policy.settings.replicas)
    else:
        store = MemoryStore()
    tokenizers = Tokenizers()
    executor = tokenize_pool()
    fleet = Fleet(interval_s=min(m.routing.scrape_interval_ms for m in
                                 policy.models.values()) / 1000.0)
    fleet.record_in_steps(RECORD_STEP_BLOCKS)
    # a counting thread holding the GIL makes the event loop wait at most this long
    sys.setswitchinterval(GIL_SWITCH_S)
    metrics = GatewayMetrics()
    predictor = OnlinePredictor(on_error=lambda target, _: _mape(metrics, predictor, target))
    if cfg.predictor_path:
        with contextlib.suppress(FileNotFoundError):
            predictor.load(cfg.predictor_path)
    scalers = {name: PoolScaler(m, fleet, metrics, launcher=LocalLauncher(
                   m, m.scaling.launcher, Path(cfg.log_dir) if cfg.log_dir else None)
                   if m.scaling.launcher else None)
               for name, m in policy.models.items() if m.scaling is not None}
    state = GatewayState(build_view(policy, tokenizers, executor, fleet, predictor,
                                    scalers=scalers), store,
                         metrics, tokenizers, executor, fleet=fleet, predictor=predictor,
                         redis_url=cfg.redis_url, scalers=scalers, flow_mode=cfg.flow_mode)
    sync_tracer(state)
    return state, PolicyWatcher(cfg.policy, state)


def _mape(metrics: GatewayMetrics, predictor: OnlinePredictor, target: str) -> None:
    value = predictor.mape(target)
    if value is not None:
        metrics.series("predictor_mape", target).set(value)


def announce(stop: asyncio.Event | None, watcher: PolicyWatcher, handle_signals: bool,
             ready: asyncio.Event | None) -> asyncio.Event:
    """The event that stops the server (with ``handle_signals``, SIGTERM and SIGINT set it and
    SIGHUP reloads the policy); ``ready`` is set: the server is listening."""
    stop = stop or asyncio.Event()
    if handle_signals:  # the process is this server's own
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        loop.add_signal_handler(signal.SIGHUP, watcher.reload)
        freeze_startup_heap()
    if (slower := native.warning()) is not None:
        log.warning("%s", slower)
    if ready is not None:
        ready.set()
    return stop


async def drain(timeout_s: float, busy: Callable[[], bool]) -> None:
    """Wait while ``busy()``, for up to ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while busy() and time.monotonic() < deadline:  # noqa: ASYNC110 - polls counters
        await asyncio.sleep(0.05)


def in_flight(state: GatewayState) -> int:
    return sum(e.live.in_flight for p in state.view.pools.values() for e in p.endpoints)


async def serve(cfg: ServeConfig, *, ready: asyncio.Event | None = None,
                stop: asyncio.Event | None = None, handle_signals: bool = False,
                prepared: tuple[GatewayState, PolicyWatcher] | None = None) -> None:
    """Serve until ``stop`` (or a signal), then drain. ``prepared`` comes from ``make_state``
    when the caller wants to look inside (tests)."""
    state, watcher = prepared or make_state(cfg)
    app = build_app(state, watcher)
    client = state.view.policy.settings.client
    GuardedHandler.header_timeout_s = client.header_timeout_s  # fixed at start
    runner = GatewayRunner(app, handler_cancellation=True, access_log=None,
                           keepalive_timeout=client.keepalive_s, lingering_time=1.0)
    await runner.setup()
    sock = socket.socket(socket.AF_INET6 if ":" in cfg.host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if cfg.reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((cfg.host, cfg.port))
    if cfg.port == 0:
        cfg.port = sock.getsockname()[1]
    await web.SockSite(runner, sock, backlog=2048).start()
    log.info("gateway listening on http://%s:%d (policy %s, store %s)", cfg.host, cfg.port,
             cfg.policy, type(state.store).__name__)
    if state.view.policy.settings.public_metrics or state.view.admin_digest is None:
        loopback = cfg.host in ("localhost", "::1") or cfg.host.startswith("127.")
        log.log(logging.INFO if loopback else logging.WARNING,
                "/metrics is public (%s): anyone who reaches %s:%d reads every tenant's usage",
                "settings.public_metrics" if state.view.policy.settings.public_metrics
                else "no admin key is configured", cfg.host, cfg.port)
    stop = announce(stop, watcher, handle_signals, ready)
    try:
        await stop.wait()
        state.draining = True
        state.drain_deadline = time.monotonic() + cfg.drain_timeout_s
        await drain(cfg.drain_timeout_s, lambda: in_flight(state) > 0)
        log.info("drained (%d still in flight); stopping", in_flight(state))
    finally:
        if cfg.predictor_path and state.predictor.models is not None:
            state.predictor.save(cfg.predictor_path)
        await runner.cleanup()
        state.tracer.shutdown()  # exports what is still batched
