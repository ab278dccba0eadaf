"""Everything the gateway's handlers share, rebuilt from each policy version."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Coroutine
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from backend.tokenizer import Tokenizer
from gateway.config.policy import Endpoint, Model, Policy
from gateway.endpoints import EndpointPool
from gateway.limiter.store import RateStore
from gateway.metrics import GatewayMetrics
from gateway.tokenize import TokenCounter
from gateway.upstream import UpstreamClient


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
    admin_digest: str | None


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
    executor: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(2, thread_name_prefix="tokenize"))
    upstream: UpstreamClient = field(default_factory=UpstreamClient)
    draining: bool = False
    background: set[asyncio.Task[Any]] = field(default_factory=set)

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Run ``coro`` to completion even if the request that started it is cancelled."""
        task = asyncio.ensure_future(coro)
        self.background.add(task)
        task.add_done_callback(self.background.discard)


def build_view(policy: Policy, tokenizers: Tokenizers, executor: ThreadPoolExecutor,
               seed: int = 0) -> PolicyView:
    import hashlib

    pools = {name: EndpointPool(m, endpoint_key, seed=seed) for name, m in policy.models.items()}
    counters = {name: _counter(m, tokenizers, executor) for name, m in policy.models.items()}
    s = policy.settings
    admin = s.admin_key_sha256
    if admin is None and s.admin_key_env and os.environ.get(s.admin_key_env):
        admin = hashlib.sha256(os.environ[s.admin_key_env].encode()).hexdigest()
    return PolicyView(policy, pools, counters, admin)


def _counter(m: Model, tokenizers: Tokenizers, executor: ThreadPoolExecutor) -> TokenCounter:
    return TokenCounter(tokenizers.get(m.tokenizer), tokens_per_message=m.tokens_per_message,
                        tokens_per_name=m.tokens_per_name, reply_priming=m.reply_priming_tokens,
                        executor=executor)


GATEWAY: web.AppKey[GatewayState] = web.AppKey("tokengate_gateway", GatewayState)
