"""The reference backend's HTTP server: routes, error shape, auth, start-up and shutdown.

Start-up mirrors a real engine: the server listens at once, but ``/health`` answers 503 and
generation requests are refused until the weights have "loaded" (model bytes per GPU divided by
the storage bandwidth, scaled by ``--time-scale``).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import signal
import socket
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
from aiohttp import web
from aiohttp.typedefs import Middleware
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from backend import admin, embeddings_api, lora_api, openai_api, pd
from backend.config import BackendConfig
from backend.lora import runtime_updates_allowed
from backend.state import STATE, BackendState
from protocol.errors import APIError, errors
from protocol.runtime import freeze_startup_heap
from protocol.tokenizer import Tokenizer

log = logging.getLogger("tokengate.backend")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
_OPEN_PATHS = frozenset({"/health", "/metrics", "/v1/models", "/kv/pull", "/kv/release"})


def _auth(key: str) -> Middleware:
    expected = f"Bearer {key}".encode()

    @web.middleware
    async def auth(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path not in _OPEN_PATHS:
            got = request.headers.get("Authorization", "").encode()
            if not hmac.compare_digest(got, expected):
                raise APIError(401, "invalid or missing API key", code="invalid_api_key")
        return await handler(request)

    return auth


async def health(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if state.engine.failed is not None:
        return web.Response(status=503, text="engine failed")
    if not state.ready:
        return web.Response(status=503, text="loading")
    return web.Response(text="ok")


async def metrics(request: web.Request) -> web.Response:
    body = generate_latest(request.app[STATE].metrics.registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def _lifecycle(app: web.Application) -> AsyncIterator[None]:
    state = app[STATE]
    if state.config.kv_events is not None:  # first: when it cannot bind, nothing is left open
        state.engine.kv_events.start(state.config.kv_events)
    state.http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=64))
    state.engine.kv_puller = pd.KVPuller(state)
    loop_task = asyncio.ensure_future(state.engine.run())
    if state.engine.tiers is not None:
        state.engine.tiers.start()

    async def load() -> None:
        # warm up while the weights load, as an engine does: the generator's vocabulary
        # scan (~0.1 s) would otherwise stall the engine loop on the first request
        await asyncio.gather(asyncio.sleep(state.load_seconds),
                             asyncio.to_thread(lambda: state.tokenizer.output_words))
        state.ready = True
        log.info("%s ready on %s:%d (%d KV blocks, role %s)", state.config.name,
                 state.config.host, state.config.port, state.engine.pool.num_blocks, state.role)

    load_task = asyncio.ensure_future(load())
    yield
    for task in (load_task, loop_task):
        task.cancel()
        # A failed engine loop already logged its exception and failed its requests.
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
    if state.engine.tiers is not None:
        await state.engine.tiers.close()
    await state.http.close()
    await state.engine.kv_events.close()
    state.executor.shutdown(wait=False, cancel_futures=True)


def build_app(state: BackendState) -> web.Application:
    middlewares: list[Middleware] = [errors]
    if state.config.api_key:
        middlewares.append(_auth(state.config.api_key))
    app = web.Application(middlewares=middlewares, client_max_size=state.config.max_body_bytes)
    app[STATE] = state
    app.cleanup_ctx.append(_lifecycle)
    r = app.router
    r.add_post("/v1/chat/completions", lambda q: openai_api.generate(q, "chat"))
    r.add_post("/v1/completions", lambda q: openai_api.generate(q, "completion"))
    r.add_post("/v1/embeddings", embeddings_api.embeddings)
    r.add_get("/v1/models", openai_api.models)
    r.add_get("/health", health)
    r.add_get("/metrics", metrics)
    r.add_post("/kv/pull", pd.pull)
    r.add_post("/kv/release", pd.release)
    r.add_get("/admin/state", admin.get_state)
    r.add_get("/admin/requests", admin.get_requests)
    r.add_post("/admin/role", admin.set_role)
    r.add_get("/admin/faults", admin.get_faults)
    r.add_post("/admin/faults", admin.set_faults)
    if state.lora is not None and runtime_updates_allowed():
        r.add_post("/v1/load_lora_adapter", lora_api.load)
        r.add_post("/v1/unload_lora_adapter", lora_api.unload)
    return app


async def serve(config: BackendConfig, *, ready: asyncio.Event | None = None,
                stop: asyncio.Event | None = None, tokenizer: Tokenizer | None = None,
                handle_signals: bool = False, state: BackendState | None = None) -> None:
    """Run one instance until ``stop`` is set (or SIGTERM/SIGINT with ``handle_signals``).

    ``state`` may be built beforehand (tests inspect it); otherwise it is made from ``config``.
    """
    state = state or BackendState.create(config, tokenizer)
    stop = stop or asyncio.Event()
    if handle_signals:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
    app = build_app(state)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    try:
        sock = _listen(config.host, config.port)
        if config.port == 0:
            config.port = sock.getsockname()[1]
        await web.SockSite(runner, sock, backlog=1024).start()
        log.info("listening on http://%s:%d (loading %s for %.2fs)", config.host, config.port,
                 config.name, state.load_seconds)
        if handle_signals:  # the process is this server's own
            freeze_startup_heap()
        if ready is not None:
            ready.set()
        await stop.wait()
        log.info("stopping")
    finally:
        await runner.cleanup()


def _listen(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port``; a failure names the address (``OSError``)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    return sock
