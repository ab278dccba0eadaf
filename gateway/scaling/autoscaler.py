"""The gateway's own autoscaler for pools with a ``scaling:`` section (the local equivalent of
HPA/KEDA acting on ``tokengate_desired_replicas``); the convertible-decoder controller's
decisions are ``gateway.scaling.conversions``.

Every ``interval_s`` a ``PoolScaler``:

1. exports the pool's token velocity (demand and capacity per stage) and desired replicas;
2. picks the target: ``velocity`` (TokenScale: demand / capacity x utilization per stage) or
   ``concurrency`` (the baseline: requests in flight per replica, as Knative's KPA), never
   below ``min_replicas`` unless the pool has been idle for ``idle_timeout_s`` (then 0 when
   ``min_replicas`` is 0), at least 1 while requests are held, at most ``max_replicas``;
3. with a launcher, acts: launches what is missing at once (cold starts), and removes one
   replica only after the target has stayed below the count for ``scale_down_delay_s``: it is
   drained first (no new requests; its streams migrate to another endpoint or, when none is
   left, finish) and then stopped;
4. in disaggregated pools with ``convertible``, converts decode endpoints to prefill (role
   ``both``: they keep decoding, ``gateway.scaling.conversions``) when the predicted prefill
   backlog exceeds ``convert_backlog_ratio`` x the TTFT SLO and no prefill capacity already
   starting will be ready before the backlog breaks the SLO, and back after the backlog
   stayed under ``revert_backlog_ratio`` x SLO for ``revert_after_s`` (hysteresis).

Requests for a pool with no ready endpoint are *held* (``hold``): bounded by ``max_held``,
each up to its route's ``hold_timeout_ms``, and they wake the pool.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable
from typing import Any

import aiohttp

from gateway.config.policy import Model
from gateway.config.scaling import Scaling
from gateway.metrics import GatewayMetrics
from gateway.routing.endpoints import EndpointPool, EndpointState
from gateway.routing.fleet import Fleet
from gateway.scaling import roles
from gateway.scaling.conversions import Conversions, starting_prefill_eta_ms
from gateway.scaling.hold import HoldGate
from gateway.scaling.launcher import Instance, LocalLauncher
from gateway.scaling.velocity import Capacity, Velocity, profile_capacity

log = logging.getLogger("tokengate.scaling")


def target_replicas(s: Scaling, desired: int, *, held: int, idle_s: float, ready: int) -> int:
    """The replica count to steer to, from the policy's desired count and the pool's state."""
    n = max(desired, s.min_replicas)
    if s.min_replicas == 0 and idle_s >= s.idle_timeout_s and not held:
        n = 0
    elif held and ready == 0:
        n = max(n, 1)
    elif s.min_replicas == 0 and idle_s < s.idle_timeout_s:
        n = max(n, 1)  # recently used: stay warm until the idle timeout
    return min(n, s.max_replicas)


class PoolScaler:
    def __init__(self, model: Model, fleet: Fleet, metrics: GatewayMetrics, *,
                 launcher: LocalLauncher | None = None, interval_s: float = 0.25,
                 clock: Callable[[], float] = time.monotonic) -> None:
        assert model.scaling is not None
        self.model = model
        self.s = model.scaling
        self.fleet = fleet
        self.metrics = metrics
        self.launcher = launcher
        self.interval_s = interval_s
        self._clock = clock
        b = model.backend
        self.capacity: Capacity = profile_capacity(
            b.model, b.sim_hardware, max_num_batched_tokens=b.max_num_batched_tokens or 8192)
        roles = {e.role for e in model.endpoints}
        self.disaggregated = bool(roles - {"both"}) or self.s.disaggregated
        self.velocity = Velocity(self.capacity, disaggregated=self.disaggregated, clock=clock)
        self.instances: list[Instance] = []
        self.gate = HoldGate(self.s.max_held, lambda n: self.metrics.series(
            "held_requests", self.model.name).set(n))
        self.below_since: float | None = None
        self.conversions = Conversions()
        self.pool: EndpointPool | None = None
        self.cold_start_s: float | None = None  # the last measured launch-to-ready time
        self.started = 0
        self.failed_starts = 0  # launches in a row that died before becoming ready
        self.launch_after = 0.0
        self._http: aiohttp.ClientSession | None = None
        self._stopping: set[asyncio.Task[None]] = set()
        # Moves a draining endpoint's streams elsewhere (LiveStreams.migrate_from).
        self.on_drain: Callable[[str], int] | None = None

    # -- the pool's live endpoints -------------------------------------------------------
    def urls(self) -> list[str]:
        return [i.url for i in self.instances]

    def attach(self, pool: EndpointPool) -> None:
        """Give ``pool`` (the current policy version's) the launched, ready, not draining
        instances besides the policy's own endpoints."""
        self.pool = pool
        static = [e for e in pool.endpoints if e.url not in self._launched_urls()]
        live = [self.fleet.endpoint(i.url, None, self._role_of(i),
                                    self.model.backend.sim_hardware)
                for i in self.instances if i.ready_at is not None and i.draining_since is None]
        pool.endpoints = static + live
        for e in live:
            pool.api_keys.setdefault(e.url, None)
        # A request can be served once something can decode it (a disaggregated pool's
        # decoder computes the prompt itself while no prefill instance is ready).
        self.gate.open(any(e.role in ("both", "decode") for e in pool.endpoints))

    def _launched_urls(self) -> set[str]:
        return {i.url for i in self.instances}

    def endpoint_states(self) -> list[EndpointState]:
        return list(self.pool.endpoints) if self.pool is not None else []

    # -- requests --------------------------------------------------------------------------
    def admitted(self, prompt_tokens: int, output_tokens: int) -> None:
        self.velocity.admitted(prompt_tokens, output_tokens)

    async def hold(self, timeout_s: float) -> bool:
        """Wait for a ready endpoint (waking the pool; ``gateway.scaling.hold``)."""
        return await self.gate.wait(timeout_s)

    @property
    def held(self) -> int:
        return self.gate.held

    # -- the control loop ------------------------------------------------------------------
    def desired(self) -> dict[str, int]:
        eps = self.endpoint_states()
        if self.s.policy == "concurrency":
            load = sum(e.live.in_flight for e in eps) + self.held
            n = math.ceil(load / self.s.target_concurrency - 1e-9)
            return {"both": n} if not self.disaggregated else {"prefill": n, "decode": n}
        observed = [e.live.prefill_rate * 1e3 for e in eps if e.live.prefill_rate]
        cap = sum(observed) / len(observed) if observed else None
        return self.velocity.desired(self.s.target_utilization, prefill_capacity=cap,
                                     convertible=self.disaggregated and self.s.convertible)

    def export(self, desired: dict[str, int]) -> None:
        name = self.model.name
        ready = len(self.endpoint_states())
        for stage, rate in self.velocity.rates().items():
            self.metrics.series("token_velocity", name, stage, "demand").set(rate)
            has_stage = stage != "transfer" or self.disaggregated
            self.metrics.series("token_velocity", name, stage, "capacity").set(
                self.capacity.of(stage) * ready if has_stage else 0.0)
        for role, n in desired.items():
            self.metrics.series("desired_replicas", name, role).set(n)
        starting = sum(1 for i in self.instances if i.ready_at is None)
        draining = sum(1 for i in self.instances if i.draining_since is not None)
        self.metrics.series("replicas", name, "starting").set(starting)
        self.metrics.series("replicas", name, "ready").set(ready)
        self.metrics.series("replicas", name, "draining").set(draining)

    async def tick(self) -> None:
        now = self._clock()
        desired = self.desired()
        self.export(desired)
        if self.launcher is not None:
            await self._poll_starting(now)
            await self._steer(desired, now)
        if self.disaggregated and self.s.convertible:
            await self._convert(now)

    async def _poll_starting(self, now: float) -> None:
        assert self.launcher is not None
        changed = False
        for inst in [i for i in self.instances if i.ready_at is None]:
            try:
                ok = await self.launcher.ready(inst, self._session())
            except RuntimeError as exc:
                # It died while starting: back off before launching again (1, 2, 4 .. 60 s),
                # so a broken launcher does not fork a process every tick.
                self.failed_starts += 1
                pause = min(2.0 ** (self.failed_starts - 1), 60.0)
                self.launch_after = now + pause
                log.error("%s: %s; next launch in %.0f s", self.model.name, exc, pause)
                self.instances.remove(inst)
                continue
            if ok:
                self.failed_starts = 0
                inst.ready_at = now
                self.cold_start_s = now - inst.started_at
                log.info("%s: %s ready after a %.1f s cold start", self.model.name, inst.url,
                         self.cold_start_s)
                changed = True
        if changed and self.pool is not None:
            self.attach(self.pool)

    async def _steer(self, desired: dict[str, int], now: float) -> None:
        assert self.launcher is not None
        live = [i for i in self.instances if i.draining_since is None]
        ready = sum(1 for i in live if i.ready_at is not None)
        static = len(self.model.endpoints)
        idle = now - self.velocity.last_request_at
        total = target_replicas(self.s, sum(desired.values()), held=self.held, idle_s=idle,
                                ready=ready + static)
        if self.disaggregated and 0 < total < 2:
            total = 2  # a disaggregated pool serves nothing without both roles
        target = max(total - static, 0)
        if target > len(live):
            self.below_since = None
            if now < self.launch_after:
                return
            for _ in range(target - len(live)):
                inst = self.launcher.start(self._role_to_add(desired))
                self.instances.append(inst)
                self.started += 1
                self.metrics.series("cold_starts", self.model.name).inc()
                log.info("%s: launching %s (target %d)", self.model.name, inst.url, target)
            return
        if target < len(live):
            if self.below_since is None:
                self.below_since = now
            # To zero at once when idle: the idle timeout already waited.
            if target == 0 or now - self.below_since >= self.s.scale_down_delay_s:
                self.below_since = now
                victim = self._victim(live, desired, target)
                victim.draining_since = now
                if self.pool is not None:
                    self.attach(self.pool)
                if self.on_drain is not None and self.pool is not None and self.pool.endpoints:
                    self.on_drain(victim.url)  # its streams continue on the others
                log.info("%s: draining %s (target %d)", self.model.name, victim.url, target)
                task = asyncio.ensure_future(self._retire(victim))
                self._stopping.add(task)
                task.add_done_callback(self._stopping.discard)
        else:
            self.below_since = None

    def _role_of(self, inst: Instance) -> str:
        return roles.role_of(inst, self.fleet.endpoints)

    def _role_to_add(self, d: dict[str, int]) -> str:
        return roles.role_to_add(self.model, self.fleet.endpoints, self.instances, d,
                                 disaggregated=self.disaggregated)

    def _victim(self, live: list[Instance], d: dict[str, int], target: int) -> Instance:
        return roles.victim(self.model, self.fleet.endpoints, live, d, target,
                            disaggregated=self.disaggregated)

    def _in_flight(self, url: str) -> int:
        return roles.in_flight(self.fleet.endpoints, url)

    async def _retire(self, inst: Instance, drain_timeout_s: float = 120.0) -> None:
        assert self.launcher is not None
        deadline = self._clock() + drain_timeout_s
        while self._in_flight(inst.url) and self._clock() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.05)
        await self.launcher.stop(inst)
        if inst in self.instances:
            self.instances.remove(inst)
        self.fleet.endpoints.pop(inst.url, None)
        self.fleet.approx.forget(inst.url)
        log.info("%s: stopped %s", self.model.name, inst.url)

    async def _convert(self, now: float) -> None:
        eps = self.endpoint_states()
        prefill = [e for e in eps if e.role in ("prefill", "both")]
        decoders = [e for e in eps if e.role == "decode"]
        rate = sum((e.live.prefill_rate or self.capacity.prefill / 1e3) for e in prefill) or 1e-9
        backlog_ms = sum(e.live.prefill_tokens for e in prefill) / rate
        # Prefill capacity already starting that is ready before the backlog breaks the SLO
        # makes a conversion needless; anything later (or a launch not yet made) does not.
        eta_ms = starting_prefill_eta_ms(self.instances, self.cold_start_s, now)
        warm_soon = eta_ms < self.s.ttft_slo_ms - backlog_ms
        action = self.conversions.decide(backlog_ms, now, self.s, decoders=len(decoders),
                                         warm_soon=warm_soon)
        if action == "convert":
            ep = min(decoders, key=lambda e: (e.live.decoding, e.live.in_flight))
            if await self._set_role(ep, "both"):  # it keeps decoding, and prefills too
                self.conversions.converted.append(ep.url)
        elif action == "revert":
            url = self.conversions.converted.pop()
            ep2 = self.fleet.endpoints.get(url)
            if ep2 is not None:
                await self._set_role(ep2, "decode")

    async def _set_role(self, ep: EndpointState, role: str) -> bool:
        old = ep.role
        try:
            async with self._session().post(ep.url.removesuffix("/v1") + "/admin/role",
                                            json={"role": role, "wait": False}) as r:
                if r.status != 200:
                    log.warning("%s: %s refused the role %s (%d)", self.model.name, ep.url,
                                role, r.status)
                    return False
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            log.warning("%s: converting %s failed: %s", self.model.name, ep.url, exc)
            return False
        ep.role = role
        self.conversions.done += 1
        self.metrics.series("role_conversions", self.model.name, old, role).inc()
        log.info("%s: converted %s from %s to %s", self.model.name, ep.url, old, role)
        return True

    def _session(self) -> aiohttp.ClientSession:
        if self._http is None or self._http.closed:
            self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5))
        return self._http

    async def run(self, current_pool: Callable[[], EndpointPool | None]) -> None:
        while True:
            pool = current_pool()
            if pool is not None and pool is not self.pool:
                self.attach(pool)
            try:
                await self.tick()
            except Exception:  # the loop must outlive any one bad tick
                log.exception("%s: scaling tick failed", self.model.name)
            await asyncio.sleep(self.interval_s)

    async def close(self) -> None:
        for t in list(self._stopping):
            t.cancel()
        if self.launcher is not None:
            for inst in list(self.instances):
                with contextlib.suppress(Exception):
                    await self.launcher.stop(inst, grace_s=5)
        self.instances.clear()
        if self._http is not None:
            await self._http.close()

    def summary(self) -> dict[str, Any]:
        return {"policy": self.s.policy, "desired": self.desired(),
                "velocity": self.velocity.rates(), "held": self.held,
                "instances": [{"url": i.url, "role": i.role,
                               "ready": i.ready_at is not None,
                               "draining": i.draining_since is not None}
                              for i in self.instances],
                "cold_start_s": self.cold_start_s, "started": self.started,
                "converted": list(self.conversions.converted),
                "conversions": self.conversions.done}
