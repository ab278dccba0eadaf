"""LoRA adapters loaded on demand: which endpoint holds which adapter, loading one where a
request is sent, unloading the least recently used beyond ``lora.max_loaded``.

What an endpoint holds is learned once from its ``/v1/models`` (adapters started with it have
a ``parent``), then kept by the gateway as it loads and unloads through vLLM's runtime API
(``POST /v1/load_lora_adapter``, ``/v1/unload_lora_adapter``); an engine that restarts is
asked again. Loads of one adapter on one endpoint are serialised, so concurrent requests
trigger one load. Each load's time is measured (a moving average per adapter) and priced into
routing: an endpoint without the adapter costs that much more TTFT.

A load the engine refuses is the operator's problem, not the client's and not the endpoint's
health: the request gets a 502 naming the adapter (``adapter_load_failed``), its reservation
is returned, the endpoint stays in rotation, and the engine's answer goes to the log only.
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


@dataclass(slots=True)
class _Held:
    """The adapters one endpoint holds, least recently used first (None: not read yet)."""

    names: OrderedDict[str, None] | None = None
    started_at: float | None = None  # the engine's process start when read


@dataclass(slots=True)
class AdapterLoader:
    held: dict[str, _Held] = field(default_factory=dict)
    load_ms: dict[str, float] = field(default_factory=dict)  # measured, per adapter
    loads: int = 0
    unloads: int = 0
    failures: int = 0
    _locks: dict[tuple[str, str], asyncio.Lock] = field(default_factory=dict)
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

    async def ensure(self, m: Model, ep: EndpointState, headers: dict[str, str],
                     limit: int | None) -> None:
        """Make ``ep`` hold adapter ``m`` (APIError 502 naming it when the engine refuses)."""
        if m.lora is None:
            return
        name = m.upstream_name
        lock = self._locks.setdefault((ep.url, name), asyncio.Lock())
        async with lock:
            h = await self._read(ep, headers)
            if h.names is not None and name in h.names:
                h.names.move_to_end(name)
                return
            t0 = time.perf_counter()
            status, text = await self._post(ep, "/v1/load_lora_adapter",
                                            {"lora_name": name, "lora_path": m.lora.path},
                                            headers)
            took = (time.perf_counter() - t0) * 1e3
            if status != 200 and not (status == 400 and "already been loaded" in text):
                self.failures += 1
                log.error("loading LoRA adapter %s on %s failed (%d): %s", name, ep.url,
                          status, text[:500])
                raise APIError(502, f"the LoRA adapter {name!r} could not be loaded on its "
                               f"engine (it answered {status}); the gateway's log has the "
                               "engine's reason", type="server_error",
                               code="adapter_load_failed")
            self.loads += 1
            prev = self.load_ms.get(name)
            self.load_ms[name] = took if prev is None else 0.7 * prev + 0.3 * took
            if h.names is None:
                return
            h.names[name] = None
            # only now, so that a load that fails never costs another adapter its place
            while limit is not None and len(h.names) > limit:
                victim = next(iter(h.names))
                await self._post(ep, "/v1/unload_lora_adapter", {"lora_name": victim},
                                 headers)
                h.names.pop(victim, None)
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
