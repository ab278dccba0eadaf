"""VTC's synthetic workloads (``simulator.vtc_suites``: overload, on/off, short/long,
weighted 1:2:3:4, weights 2:1) under ``fair`` flow control, simulated and in real time
through ``--replicas`` gateways sharing a Redis, on one reference backend.

    python -m benchmarks.sim_fairness_vtc [--suites overload,...] [--duration 30]
        [--time-scale 5] [--replicas 2] [--placement pinned,spread] [--window 10]
        [--sim-only] [--out DIR]

For each suite and side (simulated, real):

* ``service_gap``: the largest difference in weighted service (``w_in·prompt + w_out·output``
  over the weight, as the fair-share counters count it) between two tenants over any stretch
  during which both were backlogged throughout, over the run and per ``--window`` model
  seconds (flat over time, or it grows); in real time the counters are read from every
  replica's ``/admin/flow`` every 100 ms (each tenant's highest: a replica's view lags by its
  peers' unsent changes) and a tenant is backlogged while requests of it wait at some
  replica;
* ``bound``: VTC's ``2·max(w_in·L_in, w_out·M)`` (``M`` the most tokens the running batch
  holds) plus what the other replicas serve within one exchange interval,
  ``(R − 1)·S·interval`` (``gateway.flow.share``, ``S`` one replica's weighted service per
  second, measured);
* ``share_by_window``: each tenant's fraction of the weighted service delivered in each window
  (counted at the answers, by the client), which for tenants all backlogged is
  ``1 / tenants``: service in proportion to weight; ``ratio_by_window`` for ``weights``:
  tokens delivered to ``a`` over ``b``, 2 when weights hold. An answer completes a whole
  decode after its request was let through (seconds at a full batch), so these lag what the
  gateway let through; ``given`` (real time) has the same figures from the fair-share
  counters' growth in each window (the service let through, as the replicas counted it).

The backend runs ``--time-scale`` times slower than the modelled GPU and arrivals are
stretched alike; times are given back in model seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from benchmarks.common import write
from benchmarks.sim_fairness_confirm import ADMIN_KEY, MODEL, Sent, drive, running
from gateway.config.flow import FlowControl
from gateway.flow.share import INTERVAL_S
from simulator.fairness import Gap, Tenant, noisy_neighbour
from simulator.vtc_suites import SUITES, flood, suite_requests

FLOW = FlowControl(mode="fair", queue_depth=1, tpot_threshold_ms=40.0)
BACKENDS = 1
SAMPLE_S = 0.1  # real seconds between reads of /admin/flow


def capacity(duration: float) -> float:
    """Requests/s of 256/256 the pool completes under a flood (simulated)."""
    r = noisy_neighbour([Tenant("a", 60.0)], "fair", duration, backends=BACKENDS, flow=FLOW,
                        requests=lambda bs, rt: flood(60.0, duration, 0, bs, rt))
    return float(r["tenants"]["a"]["completed_per_s"])


def simulated(suite: str, cap: float, duration: float, seed: int,
              window: float) -> dict[str, Any]:
    tenants, _ = suite_requests(suite, cap, duration, seed)
    r = noisy_neighbour(tenants, "fair", duration, backends=BACKENDS, flow=FLOW, seed=seed,
                        requests=lambda bs, rt: suite_requests(suite, cap, duration, seed,
                                                               bs, rt)[1],
                        gap_flows=[t.name for t in tenants], window_s=window)
    service = {t.name: r["tenants"][t.name]["service_by_window"] for t in tenants}
    return {"service_gap": r["service_gap"], "gap_by_window": r["service_gap_by_window"],
            "vtc_bound": r["vtc_bound"], "utilisation": r["utilisation"],
            **shares(service, {t.name: t.weight for t in tenants})}


def shares(service: dict[str, list[float]], weights: dict[str, float]) -> dict[str, Any]:
    """Each tenant's fraction of each window's weighted service; for two tenants ``a`` and
    ``b`` the ratio of their (unweighted) service."""
    n = min(len(v) for v in service.values())
    out: dict[str, Any] = {"share_by_window": {
        t: [v[i] / s if (s := sum(x[i] for x in service.values())) else None
            for i in range(n)] for t, v in service.items()}}
    if set(service) == {"a", "b"}:
        out["ratio_by_window"] = [
            service["a"][i] * weights["a"] / (service["b"][i] * weights["b"])
            if service["b"][i] else None for i in range(n)]
    return out


class Sampler:
    """Every replica's fair-share counters and waiting requests, every ``SAMPLE_S``; the
    service gap of every pair of ``flows`` while both wait (at any replica)."""

    def __init__(self, admins: list[str], flows: list[str], scale: float,
                 window: float) -> None:
        self.admins, self.flows, self.scale, self.window = admins, flows, scale, window
        self.gap = Gap(flows, window)  # the simulator's measure, on the replicas' counters
        self.samples = 0
        # per window, each flow's counter (its highest over the replicas' views) when it began
        self.marks: dict[int, dict[str, float]] = {}

    async def run(self, http: aiohttp.ClientSession, t0: float) -> None:
        hdr = {"Authorization": f"Bearer {ADMIN_KEY}"}
        while True:
            await asyncio.sleep(SAMPLE_S)
            views = []
            for a in self.admins:
                async with http.get(f"{a}/admin/flow", headers=hdr) as resp:
                    views.append((await resp.json())["models"].get(MODEL, {}))
            self.sample((time.perf_counter() - t0) / self.scale, views)

    def sample(self, now: float, views: list[dict[str, Any]]) -> None:
        self.samples += 1
        waiting = [{f["flow"]: f["waiting"] for f in v.get("flows", [])} for v in views]
        served = [{f["flow"]: f["served"] for f in v.get("flows", [])} for v in views]
        # each replica's counters: the shared totals with its own unsent changes (counters
        # only grow; a replica may have forgotten a tenant idle there, below its floor)
        highest = {f: max((x[f] for x in served if f in x), default=0.0) for f in self.flows}
        self.marks.setdefault(int(now // self.window), highest)
        # backlogged: waiting at some replica (a tenant may reach one replica only)
        self.gap.sample(now, {f for f in self.flows if any(w.get(f, 0) > 0 for w in waiting)},
                        highest)


def real(suite: str, cap: float, duration: float, seed: int, scale: float, replicas: int,
         window: float, placement: str) -> dict[str, Any]:
    tenants, reqs = suite_requests(suite, cap, duration, seed)
    weights = {t.name: t.weight for t in tenants}
    log_dir = Path(tempfile.mkdtemp(prefix=f"tokengate-vtc-{suite}-"))
    with running(list(weights), FLOW, scale, log_dir, replicas, BACKENDS,
                 weights) as (bases, ports):
        names = list(weights)
        sent = [Sent(r.flow or "", r.t * scale, list(r.prompt_ids), r.output_tokens,
                     replica=names.index(r.flow or "") if placement == "pinned" else None)
                for r in reqs]
        sampler = Sampler([b.removesuffix("/v1") for b in bases], list(weights), scale, window)
        run = asyncio.run(drive(sent, bases, ports, sampler.run))
    n = max(1, math.ceil(duration / window))
    service = {t: [0.0] * n for t in weights}
    for s, r in zip(sent, reqs, strict=True):
        if s.status == 200 and s.done is not None:
            done = (s.t + s.done) / scale
            if done < duration:
                service[s.tenant][int(done // window)] += (
                    FLOW.input_weight * len(r.prompt_ids) +
                    FLOW.output_weight * s.tokens) / weights[s.tenant]
    given = {t: [(sampler.marks[w + 1][t] - sampler.marks[w][t])
                 if w in sampler.marks and w + 1 in sampler.marks else 0.0 for w in range(n)]
             for t in weights}
    model_s = run["wall_s"] / scale
    per_replica = sum(sum(v) for v in service.values()) / min(duration, model_s) / replicas
    return {"service_gap": sampler.gap.worst,
            "gap_by_window": [sampler.gap.by_window.get(w) for w in range(n)],
            "replica_term": (replicas - 1) * per_replica * INTERVAL_S,
            "samples": sampler.samples, "utilisation": run["busy_s"] / (BACKENDS * model_s),
            "lag_max_ms": run["lag_max_ms"], "errors": sum(1 for s in sent if s.status != 200),
            **shares(service, weights),
            "given": shares(given, weights)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--suites", default=",".join(SUITES))
    ap.add_argument("--duration", type=float, default=30.0, help="model seconds of arrivals")
    ap.add_argument("--time-scale", type=float, default=5.0)
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--window", type=float, default=10.0, help="model seconds")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--placement", default="pinned,spread",
                    help="pinned: each tenant's requests to one replica (tenant i to replica "
                         "i mod R, as keep-alive clients are); spread: each request to the "
                         "next replica")
    ap.add_argument("--sim-only", action="store_true")
    ap.add_argument("--out", default="benchmarks/results/fairness-vtc")
    ns = ap.parse_args()
    cap = capacity(ns.duration)
    print(f"capacity: {cap:.2f} requests/s of 256/256 on {BACKENDS} backend", flush=True)
    runs = []
    for suite in ns.suites.split(","):
        row: dict[str, Any] = {"suite": suite,
                               "simulated": simulated(suite, cap, ns.duration, ns.seed,
                                                      ns.window)}
        for placement in [] if ns.sim_only else ns.placement.split(","):
            x = real(suite, cap, ns.duration, ns.seed, ns.time_scale, ns.replicas,
                     ns.window, placement)
            x["bound"] = row["simulated"]["vtc_bound"] + x["replica_term"]
            row[f"real:{placement}"] = x
        runs.append(row)
        print(json.dumps(row), flush=True)
    write(ns.out, {"runs": runs, "capacity_rps": cap, "duration_s": ns.duration,
                   "time_scale": ns.time_scale, "replicas": ns.replicas, "window_s": ns.window,
                   "flow_control": {"mode": FLOW.mode, "queue_depth": FLOW.queue_depth,
                                    "tpot_threshold_ms": FLOW.tpot_threshold_ms}})
    print(markdown(runs))


def markdown(runs: list[dict[str, Any]]) -> str:
    def cells(v: list[float | None], f: str = "{:.0f}") -> str:
        return " / ".join("-" if x is None else f.format(x) for x in v)

    lines = ["| suite | side | service gap (worst) | bound | gap by window | shares by window "
             "| a:b by window |", "|---|---|---|---|---|---|---|"]
    for r in runs:
        for side in [k for k in r if k == "simulated" or k.startswith("real:")]:
            x = r[side]
            bound = x.get("bound", x.get("vtc_bound", 0.0))
            sh = "; ".join(f"{t} {cells(v, '{:.2f}')}" for t, v in x["share_by_window"].items())
            lines.append(f"| {r['suite']} | {side} | {x['service_gap']:.0f} | {bound:.0f} | "
                         f"{cells(x['gap_by_window'])} | {sh} | "
                         f"{cells(x.get('ratio_by_window', []), '{:.2f}')} |")
            if "given" in x:
                g = x["given"]
                sh = "; ".join(f"{t} {cells(v, '{:.2f}')}" for t, v in g["share_by_window"].items())
                lines.append(f"| {r['suite']} | {side}, let through | | | | {sh} | "
                             f"{cells(g.get('ratio_by_window', []), '{:.2f}')} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
