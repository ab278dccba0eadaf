"""``tokengate kvpool``: a KV block pool shared by every instance of a model (the role of
Mooncake Store, or of RBG's KVCache role), a program of its own.

    TOKENGATE_KVPOOL_TOKEN=SECRET tokengate kvpool --port 9600 --capacity-gb 2048 \
        [--host 127.0.0.1] [--kv-events-config JSON]

HTTP, on loopback unless ``--host`` says otherwise (JSON bodies; errors in OpenAI's shape). The
KV routes hold every instance's blocks: they require ``Authorization: Bearer <token>``, the
shared secret in ``TOKENGATE_KVPOOL_TOKEN`` (the pool refuses to start without one; backends
send it from the same variable); ``/metrics`` and ``/health`` hold no KV data and are open:

* ``POST /v1/kv/put``    ``{"block_size", "bytes_per_block", "blocks": [{"hash", "parent",
  "token_ids", "salt"}]}`` → ``{"stored": n}``: blocks an instance computed;
* ``POST /v1/kv/lookup`` ``{"hashes": [...]}`` → ``{"matched": n}``: leading blocks held;
* ``POST /v1/kv/fetch``  ``{"hashes": [...]}`` → ``{"fetched": n, "bytes": b}``: take them;
* ``GET /metrics`` (Prometheus: ``tokengate_kvpool_*``) and ``GET /health``.

Its KV events (vLLM's ZMQ format, ``medium`` POOL) let a gateway keep one index of the pool.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import signal
from collections.abc import AsyncIterator, Iterator
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from backend.config import KVPOOL_TOKEN_ENV
from backend.events import KVEventPublisher, KVEventsConfig
from backend.kvpool_store import PoolBlock, PoolStore
from protocol.errors import APIError, Handler, bad, errors
from protocol.runtime import freeze_startup_heap

log = logging.getLogger("tokengate.kvpool")
MAX_HASH = 2**64
MAX_BLOCKS = 200_000  # per request: a 3.2M-token prompt at 16 tokens per block
MIN_TOKEN = 16  # characters
STORE = web.AppKey("store", PoolStore)
EVENTS = web.AppKey("events", KVEventPublisher)


def _hash(v: Any, where: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < MAX_HASH:
        raise bad(f"{where} must be an unsigned 64-bit integer", where)
    return v


def _hashes(doc: dict[str, Any]) -> list[int]:
    raw = doc.get("hashes")
    if not isinstance(raw, list) or len(raw) > MAX_BLOCKS:
        raise bad(f"hashes must be an array of at most {MAX_BLOCKS} block hashes", "hashes")
    return [_hash(h, "hashes") for h in raw]


async def _body(request: web.Request) -> dict[str, Any]:
    try:
        doc = await request.json()
    except (ValueError, UnicodeDecodeError):
        raise bad("the body is not valid JSON") from None
    if not isinstance(doc, dict):
        raise bad("the body must be a JSON object")
    return doc


def _int(doc: dict[str, Any], key: str, lo: int, hi: int) -> int:
    v = doc.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise bad(f"{key} must be an integer in [{lo}, {hi}]", key)
    return v


def _blocks(doc: dict[str, Any]) -> list[tuple[int, PoolBlock]]:
    bs = _int(doc, "block_size", 1, 4096)
    nbytes = _int(doc, "bytes_per_block", 1, 2**40)
    raw = doc.get("blocks")
    if not isinstance(raw, list) or len(raw) > MAX_BLOCKS:
        raise bad(f"blocks must be an array of at most {MAX_BLOCKS} blocks", "blocks")
    out = []
    for b in raw:
        if not isinstance(b, dict):
            raise bad("each block is an object", "blocks")
        parent = b.get("parent")
        ids = b.get("token_ids", [])
        salt = b.get("salt")
        if not isinstance(ids, list) or len(ids) > bs or not all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**32 for t in ids):
            raise bad("token_ids must be at most block_size token ids", "blocks")
        if salt is not None and not isinstance(salt, str):
            raise bad("salt must be a string", "blocks")
        out.append((_hash(b.get("hash"), "blocks.hash"),
                    PoolBlock(None if parent is None else _hash(parent, "blocks.parent"),
                              tuple(ids), salt, nbytes, bs)))
    return out


def _publish(app: web.Application) -> None:
    events = app[STORE].drain_events()
    if events:
        app[EVENTS].publish(events)


async def put(request: web.Request) -> web.Response:
    store = request.app[STORE]
    blocks = _blocks(await _body(request))
    stored = sum(store.put(h, b) for h, b in blocks)
    _publish(request.app)
    return web.json_response({"stored": stored})


async def lookup(request: web.Request) -> web.Response:
    return web.json_response({"matched": request.app[STORE].lookup(
        _hashes(await _body(request)))})


async def fetch(request: web.Request) -> web.Response:
    n, nbytes = request.app[STORE].fetch(_hashes(await _body(request)))
    return web.json_response({"fetched": n, "bytes": nbytes})


async def health(request: web.Request) -> web.Response:
    return web.Response(text="ok")


class _Collector(Collector):
    def __init__(self, store: PoolStore) -> None:
        self._store = store

    def collect(self) -> Iterator[Metric]:
        s, st = self._store, self._store.stats
        for name, doc, v in (("capacity_bytes", "Pool capacity.", s.capacity_bytes),
                             ("used_bytes", "Bytes of blocks held.", s.used_bytes),
                             ("blocks", "Blocks held.", len(s))):
            yield GaugeMetricFamily(f"tokengate_kvpool_{name}", doc, value=v)
        for name, doc, v in (("puts", "Blocks stored.", st.puts),
                             ("lookups", "Lookups answered.", st.lookups),
                             ("lookup_blocks", "Blocks asked about by lookups.", st.lookup_blocks),
                             ("lookup_hits", "Leading blocks lookups found.", st.lookup_hits),
                             ("fetches", "Fetches answered.", st.fetches),
                             ("fetched_blocks", "Blocks fetched.", st.fetched_blocks),
                             ("bytes_in", "Bytes put.", st.bytes_in),
                             ("bytes_out", "Bytes fetched.", st.bytes_out),
                             ("evictions", "Blocks evicted (LRU).", st.evictions)):
            yield CounterMetricFamily(f"tokengate_kvpool_{name}", doc, value=v)


def check_token(token: str) -> str:
    if len(token) < MIN_TOKEN:
        raise ValueError(f"the KV pool's token ({KVPOOL_TOKEN_ENV}) must be at least {MIN_TOKEN} "
                         "characters")
    return token


def _authorize(token: str) -> Any:
    expected = f"Bearer {token}".encode()

    @web.middleware
    async def authorize(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path.startswith("/v1/kv/") and not hmac.compare_digest(
                request.headers.get("Authorization", "").encode("utf-8", "surrogateescape"),
                expected):
            raise APIError(401, "the KV pool needs its token: Authorization: Bearer <token>",
                           code="invalid_api_key")
        return await handler(request)

    return authorize


def build_app(capacity_bytes: int, *, token: str, max_body_bytes: int = 64 * 1024 * 1024
              ) -> web.Application:
    app = web.Application(middlewares=[errors, _authorize(check_token(token))],
                          client_max_size=max_body_bytes)
    store = PoolStore(capacity_bytes)
    app[STORE] = store
    app[EVENTS] = KVEventPublisher(0)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(store))

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(registry),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})

    r = app.router
    r.add_post("/v1/kv/put", put)
    r.add_post("/v1/kv/lookup", lookup)
    r.add_post("/v1/kv/fetch", fetch)
    r.add_get("/metrics", metrics)
    r.add_get("/health", health)
    return app


async def serve(host: str, port: int, capacity_bytes: int,
                kv_events: KVEventsConfig | None = None, *, token: str,
                ready: asyncio.Event | None = None, stop: asyncio.Event | None = None,
                handle_signals: bool = False) -> None:
    app = build_app(capacity_bytes, token=token)

    async def lifecycle(app: web.Application) -> AsyncIterator[None]:
        if kv_events is not None:
            app[EVENTS].start(kv_events)
        yield
        await app[EVENTS].close()

    app.cleanup_ctx.append(lifecycle)
    stop = stop or asyncio.Event()
    if handle_signals:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port)
        await site.start()
        log.info("KV pool on http://%s:%d, %.1f GB", host, port, capacity_bytes / 1e9)
        if handle_signals:  # the process is this server's own
            freeze_startup_heap()
        if ready is not None:
            ready.set()
        await stop.wait()
    finally:
        await runner.cleanup()
