"""Runs discovery for every model whose policy has a ``discovery`` section, and puts what it
finds into the current policy version's pools. Follows reloads: a model whose section
changed is followed anew, one whose section went away is forgotten."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from gateway.config.discovery import Discovery
from gateway.config.policy import Policy
from gateway.discovery import dns
from gateway.discovery.found import attach
from gateway.metrics import GatewayMetrics
from gateway.routing.endpoints import EndpointPool
from gateway.routing.fleet import Fleet

log = logging.getLogger("tokengate.discovery")

Addresses = list[tuple[str, int, str]]  # (ip, port, role)
CHECK_S = 1.0  # how often a reloaded policy's sections are compared with what runs


class Follower:
    """One model's discovery while it runs: a watcher thread (InferencePool) or a task (DNS)."""

    def __init__(self, d: Discovery, on_change: Callable[[Addresses], None]) -> None:
        self.d = d
        self.synced = asyncio.Event()
        self.task: asyncio.Task[None] | None = None
        self.watcher: Any = None
        if d.kind == "dns":
            self.task = asyncio.ensure_future(dns.follow(d, on_change, self.synced))
        else:
            from gateway.discovery.kube import PoolWatcher

            loop = asyncio.get_running_loop()

            def changed(addrs: Addresses) -> None:  # from the watcher's thread
                loop.call_soon_threadsafe(self._seen, on_change, addrs)

            self.watcher = PoolWatcher(d, changed)
            self.watcher.start()

    def _seen(self, on_change: Callable[[Addresses], None], addrs: Addresses) -> None:
        on_change(addrs)
        self.synced.set()

    def status(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.d.kind, "name": self.d.name,
                               "synced": self.synced.is_set()}
        if self.watcher is not None:
            out |= {"namespace": self.watcher.namespace, **self.watcher.counts,
                    "last_error": self.watcher.last_error}
        return out

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task
        if self.watcher is not None:
            await asyncio.to_thread(self.watcher.stop)


class Host(Protocol):
    """What discovery needs of the gateway's state (``gateway.state.GatewayState``)."""

    found: dict[str, tuple[tuple[str, str], ...]]  # model -> (url, role)
    fleet: Fleet
    metrics: GatewayMetrics

    def kept_urls(self) -> list[str]: ...

    def pools_now(self) -> tuple[Policy, Mapping[str, EndpointPool]]: ...


class Discoverer:
    def __init__(self, state: Host) -> None:
        self.state = state
        self.followers: dict[str, Follower] = {}
        self._progress = asyncio.Event()  # set whenever a model's endpoints change

    async def until_ready(self) -> None:
        while not self.ready():
            await self._progress.wait()
            self._progress.clear()

    def ready(self) -> bool:
        """Every discovering model's first list (or lookup) is in."""
        wanted = [n for n, m in self.state.pools_now()[0].models.items() if m.discovery]
        return all(n in self.followers and self.followers[n].synced.is_set() for n in wanted)

    def status(self) -> dict[str, Any]:
        return {name: {**f.status(), "endpoints": [
                    {"url": u, "role": r} for u, r in self.state.found.get(name, ())]}
                for name, f in self.followers.items()}

    async def run(self) -> None:
        try:
            while True:
                await self._sync()
                await asyncio.sleep(CHECK_S)
        finally:
            for f in self.followers.values():
                await f.stop()
            self.followers.clear()

    async def _sync(self) -> None:
        wanted = {name: m.discovery for name, m in self.state.pools_now()[0].models.items()
                  if m.discovery is not None}
        for name in list(self.followers):
            if wanted.get(name) != self.followers[name].d:
                await self.followers.pop(name).stop()
                self.state.found.pop(name, None)
        for name, d in wanted.items():
            if name not in self.followers:
                log.info("discovering %s's endpoints: %s %s", name, d.kind, d.name)
                self.followers[name] = Follower(d, functools.partial(self._changed, name, d))

    def _changed(self, model: str, d: Discovery, addrs: Addresses) -> None:
        found = tuple((d.url(ip, port), role) for ip, port, role in addrs)
        urls = [u for u, _ in found]
        before = {u for u, _ in self.state.found.get(model, ())}
        self.state.found[model] = found
        self._progress.set()
        policy, pools = self.state.pools_now()
        attach(policy, pools, self.state.fleet, self.state.found)
        self.state.fleet.retain(self.state.kept_urls())
        self.state.metrics.series("discovered_endpoints", model).set(len(urls))
        added, gone = set(urls) - before, before - set(urls)
        if added or gone:
            log.info("%s: endpoints found %s, gone %s (now %d)", model, sorted(added),
                     sorted(gone), len(urls))
