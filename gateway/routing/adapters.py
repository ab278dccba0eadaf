"""LoRA adapters loaded on demand: which endpoint holds which adapter, loading one where a
request is sent, unloading the least recently used beyond ``lora.max_loaded``.

What an endpoint holds is learned once from its ``/v1/models`` (adapters started with it have
a ``parent``), then kept by the gateway as it loads and unloads through vLLM's runtime API
(``POST /v1/load_lora_adapter``, ``/v1/unload_lora_adapter``); an engine that restarts is
asked again. One load per (endpoint, adapter) runs at a time, shared by every request that
waits for it (each waits at most its route's first-token timeout; the load goes on for the
others). Each load's time is measured (a moving average per adapter) and priced into routing:
an endpoint without the adapter costs that much more TTFT.

Every request holds its adapter on its endpoint from the load until it ends (``release``): an
adapter is never unloaded while a request holds it, and eviction beyond ``max_loaded`` takes
the least recently used adapter nobody holds (none: the endpoint holds one more for a while).

A load the engine refuses is the operator's problem, not the client's and not the endpoint's
health: the request gets a 502 naming the adapter (``adapter_load_failed``), its reservation
is returned, the endpoint stays in rotation, and the engine's answer goes to the log only.
The failure is remembered for a backoff (1 s, doubling to 60 s while it keeps failing): the
requests meanwhile get the same 502 at once, instead of each asking the engine again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import aiohttp

from gateway.config.policy import Model
from gateway.routing.endpoints import EndpointState, base_url
from protocol.errors import APIError

log = logging.getLogger("tokengate.routing")
TIMEOUT_S = 30.0
MAX_BACKOFF_S = 60.0


@dataclass(slots=True)
class _Held:
    """The adapters one endpoint holds, least recently used first (None: not read yet)."""

    names: OrderedDict[str, None] | None = None
    started_at: float | None = None  # the engine's process start when read


@dataclass(frozen=True, slots=True)
class _Failed:
    """A load the engine refused: answered the same until ``until``."""

    until: float
    backoff_s: float
    error: APIError


@dataclass(slots=True)
class AdapterLoader:
    held: dict[str, _Held] = field(default_factory=dict)
    load_ms: dict[str, float] = field(default_factory=dict)  # measured, per adapter
    loads: int = 0
    unloads: int = 0
    failures: int = 0
    _loading: dict[tuple[str, str], asyncio.Future[None]] = field(default_factory=dict)
    _failed: dict[tuple[str, str], _Failed] = field(default_factory=dict)
    _refs: dict[tuple[str, str], int] = field(default_factory=dict)  # requests holding it
    _evicting: dict[str, asyncio.Lock] = field(default_factory=dict)  # per endpoint
    _session: aiohttp.ClientSession | None = None

    def holds(self, url: str, name: str) -> bool | None:
        """Whether the endpoint holds the adapter (None: not known yet)."""
        h = self.held.get(url)
        return None if h is None or h.names is None else name in h.names

    def listed(self, url: str) -> list[str] | None:
        """The adapters the endpoint holds, least recently used first (None: not read yet)."""
        h = self.held.get(url)
        return None if h is None or h.names is None else list(h.names)

    def cost_ms(self, m: Model, ep: EndpointState) -> float:
        """What routing ``m`` (an adapter) to ``ep`` adds to its TTFT: 0 where it is loaded."""
        if m.lora is None or self.holds(ep.url, m.upstream_name):
            return 0.0
        return self.load_ms.get(m.upstream_name, m.lora.load_ms)

    def hold_count(self, url: str, name: str) -> int:
        """Requests holding adapter ``name`` on ``url`` now."""
        return self._refs.get((url, name), 0)

    async def ensure(self, m: Model, ep: EndpointState, headers: dict[str, str],
                     limit: int | None, wait_s: float = TIMEOUT_S) -> bool:
        """Make ``ep`` hold adapter ``m`` for this request (APIError 502 naming it when the
        engine refuses or refused lately; 504 after ``wait_s``). True: the request now holds
        it, and must ``release`` it when it ends."""
        if m.lora is None:
            return False
        name = m.upstream_name
        key = (ep.url, name)
        self._refs[key] = self._refs.get(key, 0) + 1  # held from now: never unloaded under it
        try:
            h = self.held.get(ep.url)
            if h is not None and h.names is not None and name in h.names and (
                    ep.engine.started_at is None or ep.engine.started_at == h.started_at):
                h.names.move_to_end(name)
                return True
            failed = self._failed.get(key)
            if failed is not None and time.monotonic() < failed.until:
                raise APIError(failed.error.status, failed.error.message,
                               type=failed.error.type, code=failed.error.code)
            task = self._loading.get(key)
            if task is None:
                task = self._loading[key] = asyncio.ensure_future(
                    self._load(m, ep, headers, limit))
                task.add_done_callback(lambda _t: self._loading.pop(key, None))
            try:
                async with asyncio.timeout(wait_s):
                    await asyncio.shield(task)  # a request that leaves does not stop it
            except TimeoutError:
                raise APIError(504, f"the LoRA adapter {name!r} was still loading after "
                               f"{wait_s:g} s", type="server_error",
                               code="adapter_load_timeout") from None
            return True
        except BaseException:
            self.release(ep.url, name)
            raise

    def release(self, url: str, name: str) -> None:
        """A request that held adapter ``name`` on ``url`` ended."""
        key = (url, name)
        n = self._refs.get(key, 0) - 1
        if n > 0:
            self._refs[key] = n
        else:
            self._refs.pop(key, None)

    async def _load(self, m: Model, ep: EndpointState, headers: dict[str, str],
                    limit: int | None) -> None:
        assert m.lora is not None
        name = m.upstream_name
        h = await self._read(ep, headers)
        if h.names is not None and name in h.names:
            h.names.move_to_end(name)
            return
        t0 = time.perf_counter()
        status, text = await self._post(ep, "/v1/load_lora_adapter",
                                        {"lora_name": name, "lora_path": m.lora.path},
                                        headers)
        took = (time.perf_counter() - t0) * 1e3
        key = (ep.url, name)
        if status != 200 and not (status == 400 and "already been loaded" in text):
            self.failures += 1
            prev = self._failed.get(key)
            backoff = min(MAX_BACKOFF_S, prev.backoff_s * 2) if prev is not None else 1.0
            log.error("loading LoRA adapter %s on %s failed (%d): %s; the requests of the "
                      "next %.0f s get the same answer", name, ep.url, status, text[:500],
                      backoff)
            err = APIError(502, f"the LoRA adapter {name!r} could not be loaded on its "
                           f"engine (it answered {status}); the gateway's log has the "
                           "engine's reason", type="server_error", code="adapter_load_failed")
            self._failed[key] = _Failed(time.monotonic() + backoff, backoff, err)
            raise err
        self._failed.pop(key, None)
        self.loads += 1
        prev_ms = self.load_ms.get(name)
        self.load_ms[name] = took if prev_ms is None else 0.7 * prev_ms + 0.3 * took
        if h.names is None:
            return
        h.names[name] = None
        # only now, so that a load that fails never costs another adapter its place
        async with self._evicting.setdefault(ep.url, asyncio.Lock()):
            while limit is not None and len(h.names) > limit:
                victim = next((n for n in h.names
                               if n != name and not self._refs.get((ep.url, n))), None)
                if victim is None:
                    break  # every other one is in use: one more for a while
                h.names.pop(victim, None)
                await self._post(ep, "/v1/unload_lora_adapter", {"lora_name": victim},
                                 headers)
                self.unloads += 1

    def forget(self, url: str) -> None:
        """The endpoint restarted or went away: ask it again next time."""
        self.held.pop(url, None)

    async def _read(self, ep: EndpointState, headers: dict[str, str]) -> _Held:
        h = self.held.setdefault(ep.url, _Held())
        started = ep.engine.started_at
        if h.names is not None and (started is None or started == h.started_at):
            return h
        try:
            async with self._http().get(base_url(ep.url) + "/v1/models",
                                        headers=headers) as r:
                doc = await r.json(content_type=None) if r.status == 200 else {}
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError):
            doc = {}
        cards = doc.get("data") if isinstance(doc, dict) else None
        if isinstance(cards, list):
            h.names = OrderedDict((str(c["id"]), None) for c in cards
                                  if isinstance(c, dict) and c.get("parent") and "id" in c)
            h.started_at = started
        return h

    async def _post(self, ep: EndpointState, path: str, body: dict[str, str],
                    headers: dict[str, str]) -> tuple[int, str]:
        try:
            async with self._http().post(base_url(ep.url) + path, json=body,
                                         headers=headers) as r:
                return r.status, await r.text()
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            return 599, f"{type(exc).__name__}: {exc}"

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=TIMEOUT_S))
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
