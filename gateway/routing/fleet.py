"""Every upstream endpoint the gateway knows, by URL, and the loops that watch them.

* ``endpoint(...)`` hands out one ``EndpointState`` per base URL, reused across pools and
  policy versions, so live counters and health survive a reload.
* ``scrape_loop`` reads each endpoint's vLLM metrics (``/metrics``) every ``interval_s``:
  queue, batch, KV usage, ``cache_config_info`` (block size, KV capacity, which sizes the
  approximate prefix index), prefix-cache counters. A failed scrape counts as a failure for
  the circuit breaker; a successful one after a trip brings the endpoint back.
* ``want_precise`` keeps the precise prefix index: each endpoint's KV events over ZMQ
  (``gateway.routing.kv_events``), from the address its policy entry gives.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import re
import time
from collections.abc import Iterable

import aiohttp

from gateway.config.endpoint import KVEvents, KVPool
from gateway.routing.adapters import AdapterLoader
from gateway.routing.approx_index import ApproxIndex
from gateway.routing.endpoints import EndpointState, base_url
from gateway.routing.kv_events import KVEventFollowers
from gateway.routing.placement import read_residency
from gateway.routing.prefix import PreciseIndex
from gateway.routing.tiers import TierIndex, read_pool_capacity, read_tier_info

log = logging.getLogger("tokengate.routing")
_LINE = re.compile(r"^(vllm:[a-z_]+|process_start_time_seconds)(\{[^}]*\})?\s+"
                   r"([-+0-9.eEinfNa]+)")
_LABEL = re.compile(r'(\w+)="([^"]*)"')
PROBE_TIMEOUT_S = 0.5
MODELS_EVERY_S = 30.0  # an engine without max_model_len in /v1/models is asked again this often


def parse_vllm_metrics(text: str) -> dict[str, float]:
    """The gauges and counters a router needs from vLLM's Prometheus text (summed over label
    sets, e.g. several model names); ``block_size``/``num_gpu_blocks`` from cache_config_info
    (and ``prefix_caching``, 1 or 0, from its ``enable_prefix_caching``);
    ``vllm:num_requests_waiting_by_reason`` as ``waiting:REASON``. Counters are read with or
    without ``_total`` (older vLLMs and the reference backend wrote both ways)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith(("vllm:", "process_start")) or "_bucket" in line:
            continue
        m = _LINE.match(line)
        if m is None:
            continue
        name, labels, value = m.group(1).removesuffix("_total"), m.group(2), m.group(3)
        if name == "vllm:num_requests_waiting_by_reason" and labels:
            reason = dict(_LABEL.findall(labels)).get("reason", "other")
            with contextlib.suppress(ValueError):
                out[f"waiting:{reason}"] = out.get(f"waiting:{reason}", 0.0) + float(value)
            continue
        if name == "vllm:cache_config_info" and labels:
            for k, v in _LABEL.findall(labels):
                if k in ("block_size", "num_gpu_blocks"):
                    with contextlib.suppress(ValueError):
                        out[k] = float(v)
                elif k == "enable_prefix_caching":
                    out["prefix_caching"] = float(v.lower() == "true")
            continue
        try:
            out[name] = out.get(name, 0.0) + float(value)
        except ValueError:
            continue
    return out


class Fleet:
    def __init__(self, *, interval_s: float = 0.2, trip_after: int = 3,
                 cooldown_s: float = 5.0) -> None:
        self.endpoints: dict[str, EndpointState] = {}
        self.adapters = AdapterLoader()  # LoRA adapters each endpoint holds
        self.approx = ApproxIndex()
        self.precise = PreciseIndex()
        self.tiers = TierIndex()
        self.kv_pools: dict[str, KVPool] = {}  # the shared KV pools policies name, by URL
        self.pool_capacity: dict[str, float] = {}  # their capacities in bytes (scraped)
        self.interval_s = interval_s
        self.trip_after = trip_after
        self.cooldown_s = cooldown_s
        self.precise_urls: dict[str, KVEvents | None] = {}
        self.kv_events = KVEventFollowers()
        self._session: aiohttp.ClientSession | None = None
        self.scrapes = 0
        self._without_metrics: set[str] = set()
        self.probe_trips = 0
        self._probing: set[str] = set()

    def record_in_steps(self, blocks: int) -> None:
        """Record long prompts in the approximate indexes ``blocks`` blocks per event-loop step
        (``ApproxIndex.chunk``): the request path's serving does this, the simulator does not."""
        for index in (self.approx, self.tiers.approx_host, self.tiers.approx_pool):
            index.chunk = blocks

    def endpoint(self, url: str, api_key: str | None, role: str, hardware: str | None,
                 ca_file: str | None = None) -> EndpointState:
        e = self.endpoints.get(url)
        if e is None:
            e = self.endpoints[url] = EndpointState(url)
        # The scrape credential: any model's key for this URL (requests use their pool's).
        e.api_key = api_key or e.api_key
        e.role, e.hardware, e.ca_file = role, hardware, ca_file
        return e

    def retain(self, urls: Iterable[str]) -> None:
        """Forget endpoints no policy names any more (a reload removed them)."""
        keep = set(urls)
        for url in list(self.endpoints):
            if url not in keep:
                del self.endpoints[url]
                self.approx.forget(url)
                self.tiers.forget(url)
                self.precise_urls.pop(url, None)
                self.kv_events.drop(url)
                self.precise.clear(url)

    def want_precise(self, configs: dict[str, KVEvents | None], root: int) -> None:
        """Follow these endpoints' KV events (an endpoint without a configured stream is
        said once, loudly: its precise index stays empty)."""
        for url, cfg in configs.items():
            self.precise.set_root(url, root)
            if cfg is None and url not in self.precise_urls:
                log.warning("routing.index is precise but endpoint %s has no kv_events: its "
                            "cache is invisible to routing", url)
            self.precise_urls[url] = cfg

    def want_pool(self, pool: KVPool, root: int, precise: bool) -> None:
        """Know this shared KV pool: its capacity (scraped) and, for a precise index, its
        KV events, kept in the precise index under the pool's URL."""
        self.kv_pools[pool.url] = pool
        if precise:
            self.precise.set_root(pool.url, root)
            if pool.kv_events is None and pool.url not in self.precise_urls:
                log.warning("routing.index is precise but kv_pool %s has no kv_events: what "
                            "it holds is invisible to routing", pool.url)
            self.precise_urls[pool.url] = pool.kv_events

    async def scrape_pool(self, url: str) -> None:
        if url in self.pool_capacity and self.scrapes % 25:
            return  # its capacity is known: read it again every ~25 scrapes
        try:
            async with self._http().get(url + "/metrics") as r:
                if r.status != 200:
                    return
                text = await r.text()
        except (aiohttp.ClientError, OSError, TimeoutError):
            return
        cap = read_pool_capacity(text)
        if cap is None:
            return
        self.pool_capacity[url] = cap
        sizes = [e.engine.block_bytes for e in self.endpoints.values() if e.engine.block_bytes]
        if sizes:
            self.tiers.set_pool_capacity(url, max(int(cap // max(sizes)), 1))

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=max(1.0, 5 * self.interval_s)))
        return self._session

    async def scrape(self, e: EndpointState) -> bool:
        headers = {"Authorization": f"Bearer {e.api_key}"} if e.api_key else {}
        try:
            async with self._http().get(base_url(e.url) + "/metrics", headers=headers) as r:
                if r.status in (404, 405):
                    self._no_metrics(e)
                    return False
                if r.status != 200:
                    raise aiohttp.ClientError(f"/metrics answered {r.status}")
                text = await r.text()
        except (aiohttp.ClientError, OSError, TimeoutError):
            e.health.count_failure(time.monotonic(), self.trip_after, self.cooldown_s)
            return False
        m = parse_vllm_metrics(text)
        host = e.engine.host_blocks
        read_tier_info(text, e.engine)
        e.engine.model_wait_s, e.engine.resident = read_residency(text)
        if e.engine.host_blocks and e.engine.host_blocks != host:
            self.tiers.set_host_capacity(e.url, e.engine.host_blocks)
        e.engine.running = m.get("vllm:num_requests_running", 0.0)
        e.engine.waiting = m.get("vllm:num_requests_waiting", 0.0)
        e.engine.kv_usage = m.get("vllm:kv_cache_usage_perc",
                                  m.get("vllm:gpu_cache_usage_perc", 0.0))
        e.engine.prefix_queries = m.get("vllm:prefix_cache_queries", e.engine.prefix_queries)
        e.engine.prefix_hits = m.get("vllm:prefix_cache_hits", e.engine.prefix_hits)
        v = e.engine
        v.prompt_tokens_cached = m.get("vllm:prompt_tokens_cached", v.prompt_tokens_cached)
        v.external_prefix_queries = m.get("vllm:external_prefix_cache_queries",
                                          v.external_prefix_queries)
        v.external_prefix_hits = m.get("vllm:external_prefix_cache_hits",
                                       v.external_prefix_hits)
        v.preemptions = m.get("vllm:num_preemptions", v.preemptions)
        v.waiting_by_reason = {k[8:]: x for k, x in m.items() if k.startswith("waiting:")}
        started = m.get("process_start_time_seconds")
        if started is not None and v.started_at is not None and started != v.started_at:
            # The engine restarted: its cache is empty whatever the index remembers.
            log.warning("endpoint %s restarted: forgetting what its cache held", e.url)
            self.approx.forget(e.url)
            self.tiers.forget(e.url)
            self.precise.clear(e.url)
            self.adapters.forget(e.url)
            v.max_model_len, v.models_read_at = None, -math.inf
        v.started_at = started if started is not None else v.started_at
        if v.max_model_len is None and time.monotonic() - v.models_read_at > MODELS_EVERY_S:
            v.models_read_at = time.monotonic()
            await self._read_models(e, headers)
        if "block_size" in m:
            e.engine.block_size = int(m["block_size"])
        if "prefix_caching" in m:
            e.engine.prefix_caching = m["prefix_caching"] > 0
        if "num_gpu_blocks" in m and int(m["num_gpu_blocks"]) != e.engine.num_gpu_blocks:
            e.engine.num_gpu_blocks = int(m["num_gpu_blocks"])
            self.approx.set_capacity(e.url, e.engine.num_gpu_blocks)
        e.engine.scraped_at = time.monotonic()
        if e.health.down_until and e.health.consecutive_failures and not e.health.answer_failures:
            e.health.reset_health()  # it was out for transport failures: reachable again
        self.scrapes += 1
        return True

    def _no_metrics(self, e: EndpointState) -> None:
        """The engine answered but has no ``/metrics`` (an OpenAI-compatible server without
        Prometheus): it is reachable; its saturation is the gateway's own counts alone."""
        if e.url not in self._without_metrics:
            self._without_metrics.add(e.url)
            log.warning("endpoint %s has no /metrics: routing and flow control see only "
                        "what this replica sent it", e.url)
        if e.health.down_until and e.health.consecutive_failures and not e.health.answer_failures:
            e.health.reset_health()

    async def _read_models(self, e: EndpointState, headers: dict[str, str]) -> None:
        """The context length the engine serves (``max_model_len`` in vLLM's /v1/models)."""
        try:
            async with self._http().get(base_url(e.url) + "/v1/models", headers=headers) as r:
                if r.status != 200:
                    return
                doc = await r.json(content_type=None)
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError):
            return
        lens = [m.get("max_model_len") for m in (doc.get("data") or [])
                if isinstance(m, dict)] if isinstance(doc, dict) else []
        found = [int(x) for x in lens if isinstance(x, int) and x > 0]
        if found:
            e.engine.max_model_len = min(found)

    def suspect(self, e: EndpointState) -> None:
        """A request to ``e`` failed at the transport (refused, closed mid-stream, stalled):
        probe its ``/health`` now rather than at the next scrape, and take it out at once if
        the probe fails too, so that new requests go elsewhere within milliseconds of a crash
        (one dropped connection on a healthy endpoint does not trip it)."""
        if e.url in self._probing:
            return
        self._probing.add(e.url)
        task = asyncio.ensure_future(self._probe(e))
        task.add_done_callback(lambda _: self._probing.discard(e.url))

    async def _probe(self, e: EndpointState) -> None:
        headers = {"Authorization": f"Bearer {e.api_key}"} if e.api_key else {}
        try:
            async with self._http().get(base_url(e.url) + "/health", headers=headers,
                                        timeout=aiohttp.ClientTimeout(total=PROBE_TIMEOUT_S)
                                        ) as r:
                if r.status == 200:
                    return
        except (aiohttp.ClientError, OSError, TimeoutError):
            pass
        self.probe_trips += 1
        e.health.consecutive_failures = max(e.health.consecutive_failures, self.trip_after)
        e.health.trip(time.monotonic() + self.cooldown_s)
        log.warning("endpoint %s failed its health probe: out for %.0f s (back sooner if a "
                    "scrape succeeds)", e.url, self.cooldown_s)

    async def scrape_loop(self) -> None:
        while True:
            eps = list(self.endpoints.values())
            if eps or self.kv_pools:
                await asyncio.gather(*(self.scrape(e) for e in eps),
                                     *(self.scrape_pool(u) for u in self.kv_pools))
            for url, cfg in self.precise_urls.items():
                if cfg is not None:
                    self.kv_events.follow(url, cfg, self.precise.apply, self.precise.clear)
            await asyncio.sleep(self.interval_s)

    async def close(self) -> None:
        await self.kv_events.close()
        await self.adapters.close()
        if self._session is not None:
            await self._session.close()
