"""Everything the gateway's handlers share, rebuilt from each policy version."""

from __future__ import annotations

import asyncio
import os
import random
from collections.abc import Coroutine, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from gateway.config.endpoint import Endpoint
from gateway.config.policy import Model, Policy
from gateway.counting.slots import CountingSlots
from gateway.counting.tokenize import TokenCounter
from gateway.discovery.found import Found
from gateway.discovery.found import attach as attach_found
from gateway.discovery.found import urls as found_urls
from gateway.discovery.manager import Discoverer
from gateway.flow.control import FlowGates
from gateway.flow.share import CounterShare
from gateway.metrics import GatewayMetrics
from gateway.quota.limiter.store import RateStore
from gateway.request.migrate import LiveStreams
from gateway.request.upstream import UpstreamClient
from gateway.routing.endpoints import EndpointPool
from gateway.routing.fleet import Fleet
from gateway.routing.prefix_hints import PrefixShare
from gateway.routing.router import Router
from gateway.scaling.autoscaler import PoolScaler
from gateway.spend.ledger import SpendLedger
from gateway.spend.sentry import Sentry
from gateway.tracing import Tracer
from predictor.online import OnlinePredictor
from predictor.sync import ModelSync
from protocol.tokenizer import Tokenizer


def endpoint_key(e: Endpoint) -> str | None:
    """An endpoint's upstream credential: inline, or from the environment."""
    if e.api_key:
        return e.api_key
    if e.api_key_env:
        return os.environ.get(e.api_key_env)
    return None


@dataclass(slots=True, eq=False)
class PolicyView:
    """One policy version with its pools and token counters."""

    policy: Policy
    pools: dict[str, EndpointPool]
    counters: dict[str, TokenCounter]
    routers: dict[str, Router]
    admin_digest: str | None


def tokenize_pool() -> ThreadPoolExecutor:
    """The worker pool that tokenizes requests with much text: one thread per core."""
    return ThreadPoolExecutor(os.cpu_count() or 2, thread_name_prefix="tokenize")


class Tokenizers:
    """Tokenizers by name, loaded once per process and shared by every policy version."""

    def __init__(self) -> None:
        self._cache: dict[str, Tokenizer] = {}

    def get(self, name: str) -> Tokenizer:
        tok = self._cache.get(name)
        if tok is None:
            tok = self._cache[name] = Tokenizer(name)
        return tok


@dataclass(slots=True, eq=False)
class GatewayState:
    view: PolicyView
    store: RateStore
    metrics: GatewayMetrics
    tokenizers: Tokenizers
    executor: ThreadPoolExecutor = field(default_factory=lambda: tokenize_pool())
    fleet: Fleet = field(default_factory=Fleet)
    predictor: OnlinePredictor = field(default_factory=OnlinePredictor)
    upstream: UpstreamClient = field(default_factory=UpstreamClient)
    redis_url: str | None = None  # shares the predictor across replicas when set
    sync: ModelSync | None = None
    share: PrefixShare | None = None  # prefix hints from and to the other replicas
    scalers: dict[str, PoolScaler] = field(default_factory=dict)  # pools with scaling:
    live: LiveStreams = field(default_factory=LiveStreams)  # streams that may be migrated
    draining: bool = False
    drain_deadline: float | None = None  # time.monotonic() by which shutdown must be done
    tracer: Tracer = field(default_factory=lambda: Tracer(None))
    background: set[asyncio.Task[Any]] = field(default_factory=set)
    rng: random.Random = field(default_factory=random.Random)  # retry backoff jitter
    flow_mode: str | None = None  # ``--flow-control``: overrides the policy's mode
    flow: FlowGates = field(init=False)  # flow control's gate per model
    flow_share: CounterShare | None = None  # the fair-share counters shared through Redis
    spend: SpendLedger = field(init=False)  # what every request cost
    sentry: Sentry = field(init=False)  # stops runaway agent sessions
    counting: CountingSlots = field(init=False)  # a tenant's share of the tokenize pool
    # endpoints discovery found, by model (``gateway.discovery``), and what finds them
    found: dict[str, tuple[tuple[str, str], ...]] = field(default_factory=dict)
    discoverer: Discoverer = field(init=False)

    def __post_init__(self) -> None:
        self.flow = FlowGates(self.metrics, self.flow_mode)
        self.sentry = Sentry(self.metrics)
        self.counting = CountingSlots(self.executor._max_workers)
        self.discoverer = Discoverer(self)
        self.spend = SpendLedger(
            self.metrics, time_zone=lambda: self.view.policy.settings.time_zone,
            tenant_label=lambda t: t if self.view.policy.settings.metrics_tenant_label
            else "*", log_records=lambda: self.view.policy.settings.spend.log)

    def kept_urls(self) -> list[str]:
        return kept_urls(self.view.policy, self.scalers, self.found)

    def pools_now(self) -> tuple[Policy, Mapping[str, EndpointPool]]:
        return self.view.policy, self.view.pools

    def readiness(self) -> tuple[int, str]:
        """What ``/ready`` answers (``serve``, and the EPP through its proxy)."""
        if self.draining:
            return 503, "draining"
        if not self.discoverer.ready():
            return 503, "discovering endpoints"
        return 200, "ready"

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Run ``coro`` to completion even if the request that started it is cancelled."""
        task = asyncio.ensure_future(coro)
        self.background.add(task)
        task.add_done_callback(self.background.discard)


def kept_urls(policy: Policy, scalers: Mapping[str, PoolScaler] | None,
              found: Found | None) -> list[str]:
    """Every endpoint some pool holds: the policy's, the launched ones, the discovered."""
    launched = [u for sc in (scalers or {}).values() for u in sc.urls()]
    return ([e.url for m in policy.models.values() for e in m.endpoints] + launched
            + found_urls(found or {}))


def build_view(policy: Policy, tokenizers: Tokenizers, executor: ThreadPoolExecutor,
               fleet: Fleet, predictor: OnlinePredictor | None,
               counters_from: PolicyView | None = None,
               scalers: Mapping[str, PoolScaler] | None = None,
               found: Found | None = None) -> PolicyView:
    """Pools, routers and token counters for one policy version. Endpoint state lives in the
    fleet (by URL) and token counters are kept across versions when the tokenizer settings
    are unchanged, so a reload loses neither live counters nor caches."""
    import hashlib

    pools = {}
    for name, m in policy.models.items():
        pool = EndpointPool(m, [fleet.endpoint(e.url, endpoint_key(e), e.role,
                                               e.hardware or m.backend.hardware,
                                               e.tls_ca_file)
                                for e in m.endpoints],
                            trip_after=fleet.trip_after, cooldown_s=fleet.cooldown_s,
                            retries=policy.settings.retries,
                            api_keys={e.url: endpoint_key(e) for e in m.endpoints})
        pools[name] = pool
    attach_found(policy, pools, fleet, found or {})
    fleet.retain(kept_urls(policy, scalers, found))
    for name, sc in (scalers or {}).items():
        if name in pools:
            sc.attach(pools[name])  # launched endpoints join the new version's pool
    routers = {name: Router(pool, fleet, predictor) for name, pool in pools.items()}
    counters = {}
    for name, m in policy.models.items():
        old = counters_from.counters.get(name) if counters_from else None
        same = old is not None and counters_from is not None and _same_counting(
            counters_from.policy.models[name], m)
        counters[name] = old if same and old is not None else _counter(m, tokenizers, executor)
    s = policy.settings
    admin = s.admin_key_sha256
    if admin is None and s.admin_key_env and os.environ.get(s.admin_key_env):
        admin = hashlib.sha256(os.environ[s.admin_key_env].encode()).hexdigest()
    return PolicyView(policy, pools, counters, routers, admin)


def _same_counting(a: Model, b: Model) -> bool:
    def key(m: Model) -> tuple[object, ...]:
        return (m.tokenizer, m.chat_template, m.tokens_per_message, m.tokens_per_name,
                m.reply_priming_tokens)
    return key(a) == key(b)


def _counter(m: Model, tokenizers: Tokenizers, executor: ThreadPoolExecutor) -> TokenCounter:
    return counter_for(m, tokenizers.get(m.tokenizer), executor)


def counter_for(m: Model, tokenizer: Tokenizer, executor: ThreadPoolExecutor | None = None
                ) -> TokenCounter:
    """The model's token counting (its template and chat accounting) over ``tokenizer``."""
    return TokenCounter(tokenizer, template=m.chat_template,
                        tokens_per_message=m.tokens_per_message,
                        tokens_per_name=m.tokens_per_name, reply_priming=m.reply_priming_tokens,
                        executor=executor)


def sync_tracer(state: GatewayState) -> None:
    """The tracer for the policy in force (a new one when its tracing section changed)."""
    want = state.view.policy.settings.tracing
    if state.tracer.config != want:
        old, state.tracer = state.tracer, Tracer(want)
        old.shutdown()


GATEWAY: web.AppKey[GatewayState] = web.AppKey("tokengate_gateway", GatewayState)
