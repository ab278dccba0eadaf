"""Real time confirms the many-model simulation: one reference backend hosting six models
behind the gateway, started by ``tokengate up`` from a policy in which the six models list
the same endpoint (``backend.pooling: token``), against ``simulator.multimodel`` on the
same long-tail arrivals.

    python -m benchmarks.sim_models_confirm [--models 6] [--rate 0.5] [--duration 90]
                                            [--rounds 2] [--first-round 0]
                                            [--time-scale 1] [--direct] [--out DIR]

Six Llama-3-8B models do not fit on one H100 together (16 GB of weights each, 74.7 GB for
weights and KV): the backend switches weights in and out over PCIe as the simulator models
it. The policy lists the models in the simulated instance's order, so the backend starts
with the same models resident. Each request is a completion whose prompt is a token array of
the trace's length, with ``ignore_eos`` and ``max_tokens`` its output length, streamed; TTFT
is measured from the scheduled send. Reported, every round: attainment (TTFT ≤ 2 s, TPOT ≤
50 ms), TTFT mean, p50 and p90, TPOT mean and p50, and switches, real over simulated; and
request by request (``per_request``), the median real/simulated ratio of TTFT and TPOT and
the share of requests within 15 %. Every request's figures are kept in ``report.json``.

The path between the client and the engine (the client's, the gateway's and the backend's
event loops and HTTP) is measured, not modelled: every request carries an ``X-Request-Id``,
and the backend's ``/admin/requests`` gives, on the host's monotonic clock, when each reached
the engine and when its first token left it. Each round reports its TTFT in stages
(``stages``: ``late``, the client's send after its scheduled instant; ``in``, to the engine;
``engine``, the engine's own TTFT; ``out``, back to the client), and the simulation of the
round runs with the medians of ``late`` + ``in`` and of ``out`` as its path
(``FleetConfig.path_in_s``/``path_out_s``): ~7 ms a request through the gateway on a 2-core
machine, against a median TTFT of ~35 ms, which the engine model alone leaves out
(``real_over_engine_only`` is the comparison without it; ``engine_ttft_ratio_p50``, request by
request, the engine's TTFT real over simulated, is the engine model's alone). Before the round,
``PROBES`` small requests one at a time measure the same path on an idle stack (``path``).
``--time-scale S`` (default 1: real time) runs the backend's kernels and switches S times
slower and the arrivals S times further apart, and reports model time (measured / S); the
path then weighs S times less against the modelled GPU time.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import hashlib
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import yaml

from benchmarks.common import engine_requests, write
from benchmarks.routing import stop_stack, wait_stack
from protocol.loopback import free_port
from roofline.profiles import HARDWARE, MODELS
from simulator.longtail import ModelRequest, longtail
from simulator.multimodel import FleetConfig, run_fleet

KEY = "confirm-key"
TTFT_S, TPOT_S = 2.0, 0.05


def policy(models: list[str], port: int) -> dict[str, Any]:
    m = {"endpoints": [{"url": f"http://127.0.0.1:{port}/v1"}],
         "backend": {"model": "llama-3-8b", "hardware": "h100-sxm", "pooling": "token"},
         "routing": {"strategy": "predicted"}}
    return {"version": 1, "models": {name: dict(m) for name in models},
            "tenants": {"bench": {"keys": [{"sha256": hashlib.sha256(KEY.encode()).hexdigest()}
                                           ]}},
            "routes": {"all": {"tenants": ["bench"], "models": models}}}


async def send(http: aiohttp.ClientSession, base: str, r: ModelRequest, t0: float,
               scale: float, stamps: dict[str, tuple[float, float, float]]) -> None:
    """``r`` at its scheduled time; ``stamps[id]``: (scheduled, sent, first chunk), on the
    host's monotonic clock (the engine's, ``/admin/requests``)."""
    scheduled = t0 + r.t * scale
    await asyncio.sleep(max(0.0, scheduled - time.monotonic()))
    body = {"model": r.model, "prompt": [1000 + (r.rid * 7 + i) % 5000
                                         for i in range(r.prompt_tokens)],
            "max_tokens": r.output_tokens, "ignore_eos": True, "stream": True}
    rid = f"confirm-{r.rid}"
    sent = time.monotonic()
    async with http.post(f"{base}/completions", json=body, headers={
            "Authorization": f"Bearer {KEY}", "X-Request-Id": rid}) as resp:
        if resp.status != 200:
            return
        async for line in resp.content:
            if not line.startswith(b"data: {"):
                continue
            at = time.monotonic()
            now = (at - t0) / scale  # model time
            if r.first_token is None:
                r.first_token = now
                stamps[rid] = (scheduled, sent, at)
            r.tokens += 1
            r.done = now


def stages(stamps: dict[str, tuple[float, float, float]], engine: dict[str, Any],
           scale: float) -> dict[str, Any]:
    """Each request's TTFT in stages, model ms (median and mean): ``late`` (the client's
    send after its scheduled instant), ``in`` (to the engine), ``engine`` (the engine's
    TTFT) and ``out`` (its first token back to the client); ``per_request``: id -> the
    engine's TTFT."""
    rows = {rid: (sent - sched, e["arrival"] - sent, e["first_token"] - e["arrival"],
                  first - e["first_token"])
            for rid, (sched, sent, first) in stamps.items()
            if (e := engine.get(rid)) is not None and e["first_token"] is not None}
    out: dict[str, Any] = {"requests": len(rows)}
    for k, name in enumerate(("late", "in", "engine", "out")):
        v = np.array([r[k] for r in rows.values()]) / scale * 1e3
        if len(v):
            out[name] = {"p50": float(np.median(v)), "mean": float(np.mean(v))}
    out["per_request"] = {rid: r[2] / scale * 1e3 for rid, r in rows.items()}
    return out


def figures(reqs: list[ModelRequest]) -> dict[str, Any]:
    ttft = np.array([r.ttft for r in reqs if r.ttft is not None]) * 1e3
    tpot = np.array([r.tpot for r in reqs if r.tpot is not None]) * 1e3
    return {"attainment": float(np.mean([r.meets(TTFT_S, TPOT_S) for r in reqs])),
            "ttft_mean_ms": float(np.mean(ttft)), "tpot_mean_ms": float(np.mean(tpot)),
            "ttft_p50_ms": float(np.percentile(ttft, 50)),
            "ttft_p90_ms": float(np.percentile(ttft, 90)),
            "tpot_p50_ms": float(np.percentile(tpot, 50)), "completed": len(ttft)}


def rows(reqs: list[ModelRequest]) -> list[list[Any]]:
    """Each request: id, model, arrival, prompt and output tokens, TTFT and TPOT (ms)."""
    return [[r.rid, r.model, round(r.t, 3), r.prompt_tokens, r.output_tokens,
             None if r.ttft is None else round(r.ttft * 1e3, 2),
             None if r.tpot is None else round(r.tpot * 1e3, 3)] for r in reqs]


def agreement(real_rows: list[list[Any]], sim_rows: list[list[Any]]) -> dict[str, float]:
    """Request by request, real over simulated TTFT and TPOT: the median ratio and the share
    of requests within 15 % (a percentile of a bimodal distribution can swing on one
    request; these cannot)."""
    sim = {row[0]: row for row in sim_rows}
    out: dict[str, float] = {}
    for col, name in ((5, "ttft"), (6, "tpot")):
        ratios = [row[col] / sim[row[0]][col] for row in real_rows
                  if row[col] and sim.get(row[0]) and sim[row[0]][col]]
        if ratios:
            out[f"{name}_ratio_p50"] = float(np.median(ratios))
            out[f"{name}_within_15pct"] = float(np.mean([abs(x - 1) <= 0.15 for x in ratios]))
    return out


def real(reqs: list[ModelRequest], models: list[str], log_dir: Path, direct: bool = False,
         scale: float = 1.0) -> dict[str, Any]:
    """The stack through ``tokengate up``; ``direct``: sent to the backend, not the gateway."""
    port, gw_port = free_port(), free_port()
    pol = log_dir / "policy.yaml"
    pol.write_text(yaml.safe_dump(policy(models, port), sort_keys=False))
    with open(log_dir / "up.log", "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tokengate", "up", "--policy", str(pol), "--port",
             str(gw_port), "--log-dir", str(log_dir), "--time-scale", str(scale)],
            stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True)
    try:
        asyncio.run(wait_stack(proc, gw_port, log_dir, "pooled"))
        base = f"http://127.0.0.1:{port if direct else gw_port}/v1"
        path = asyncio.run(measure_path(base, port, models[0]))
        live = [ModelRequest(r.rid, r.model, r.t, r.prompt_tokens, r.output_tokens)
                for r in reqs]
        state = asyncio.run(drive(live, port if direct else gw_port, port, scale))
        return {**figures(live), "per_request": rows(live), "path": path,
                "stages": state["stages"],
                "switches": state["pooling"]["switches"],
                "lag_max_s": state["loop"]["max_lag_s"], "resyncs": state["loop"]["resyncs"],
                "steps": state["loop"]["steps"]}
    finally:
        stop_stack(proc)


PROBES = 20  # requests that measure the path before a round


async def measure_path(base: str, port: int, model: str, probes: int = PROBES
                       ) -> dict[str, float]:
    """The fixed cost of the path between this client and the engine, in real seconds: a few
    small streamed requests one at a time, each timed by the client and, by its
    ``X-Request-Id``, by the engine (``/admin/requests``, the host's monotonic clock).
    ``in_s``: from the send to the engine's arrival; ``out_s``: from the engine's first token
    to the client's first chunk (medians)."""
    sent: dict[str, tuple[float, float]] = {}
    async with aiohttp.ClientSession() as http:
        for i in range(probes):
            rid = f"path-probe-{i}-{time.monotonic_ns()}"
            body = {"model": model, "prompt": [3000 + i] * 16, "max_tokens": 2,
                    "ignore_eos": True, "stream": True}
            t = time.monotonic() + 0.05  # sent at a scheduled instant, as a round's requests
            await asyncio.sleep(t - time.monotonic())
            async with http.post(f"{base}/completions", json=body, headers={
                    "Authorization": f"Bearer {KEY}", "X-Request-Id": rid}) as resp:
                first = None
                async for line in resp.content:
                    if first is None and line.startswith(b"data: {"):
                        first = time.monotonic()
            if resp.status == 200 and first is not None:
                sent[rid] = (t, first)
        engine = await engine_requests(http, port)
    ins = [engine[k]["arrival"] - t for k, (t, _) in sent.items() if k in engine]
    outs = [f - engine[k]["first_token"] for k, (_, f) in sent.items()
            if k in engine and engine[k]["first_token"] is not None]
    if not ins or not outs:
        raise RuntimeError("the engine did not report the probes (X-Request-Id not carried?)")
    return {"in_s": float(np.median(ins)), "out_s": float(np.median(outs)),
            "probes": len(ins)}


async def drive(live: list[ModelRequest], gw_port: int, port: int, scale: float
                ) -> dict[str, Any]:
    base = f"http://127.0.0.1:{gw_port}/v1"
    stamps: dict[str, tuple[float, float, float]] = {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as http:
        t0 = time.monotonic() + 0.5
        await asyncio.gather(*(send(http, base, r, t0, scale, stamps) for r in live))
        async with http.get(f"http://127.0.0.1:{port}/admin/state") as resp:
            state: dict[str, Any] = await resp.json()
        engine = await engine_requests(http, port)
    return {**state, "stages": stages(stamps, engine, scale)}


def ratios(a: dict[str, Any], b: dict[str, Any], keys: tuple[str, ...]) -> dict[str, float]:
    return {k: a[k] / b[k] for k in keys if b[k]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", type=int, default=6)
    ap.add_argument("--rate", type=float, default=0.5)
    ap.add_argument("--duration", type=float, default=90.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--first-round", type=int, default=0,
                    help="round K uses arrivals seed 100 + K (to add rounds to a report)")
    ap.add_argument("--out", default="benchmarks/results/models-confirm")
    ap.add_argument("--direct", action="store_true",
                    help="send to the backend directly (the gateway's share of a gap)")
    ap.add_argument("--time-scale", type=float, default=1.0,
                    help="kernels and arrivals this many times slower; figures in model time")
    ns = ap.parse_args()
    runs = []
    for k in range(ns.first_round, ns.first_round + ns.rounds):
        reqs = longtail(ns.models, ns.rate, ns.duration, seed=100 + k)
        cfg = FleetConfig(1, "token", MODELS["llama-3-8b"], HARDWARE["h100-sxm"],
                          per_instance=ns.models, seed=k)
        engine_only = run_fleet(reqs, cfg)
        # the policy lists the models in the simulated instance's order (placement's, by
        # token velocity): the backend preloads the first that fit, as the simulator does
        models = engine_only.hosts[0]
        measured = real(reqs, models, Path(tempfile.mkdtemp(prefix="tokengate-models-")),
                        ns.direct, ns.time_scale)
        # the simulation with the path the round's requests met (model time): the client's
        # late sends and the way to the engine, and the way back (medians, /admin/requests)
        st = measured["stages"]
        path_in = (st["late"]["p50"] + st["in"]["p50"]) / 1e3
        path_out = st["out"]["p50"] / 1e3
        sim = run_fleet(reqs, dataclasses.replace(cfg, path_in_s=path_in, path_out_s=path_out))
        simulated = {**figures(sim.requests), "per_request": rows(sim.requests),
                     "switches": sim.instances[0].mux.stats.switches}
        keys = ("attainment", "ttft_mean_ms", "ttft_p50_ms", "ttft_p90_ms", "tpot_mean_ms",
                "tpot_p50_ms")
        bare = figures(engine_only.requests)
        # the engine's own TTFT, request by request: real (``/admin/requests``) over simulated
        eng = measured["stages"].pop("per_request")
        sim_eng = {f"confirm-{r.rid}": (r.first_token - r.t - path_in - path_out) * 1e3
                   for r in sim.requests if r.first_token is not None}
        eng_ratio = [eng[k] / v for k, v in sim_eng.items() if k in eng and v > 0]
        runs.append({"round": k, "requests": len(reqs), "real": measured,
                     "simulated": simulated, "real_over_sim": ratios(measured, simulated, keys),
                     "real_over_engine_only": ratios(measured, bare, keys),
                     "per_request": {**agreement(measured["per_request"],
                                                 simulated["per_request"]),
                                     "engine_ttft_ratio_p50": float(np.median(eng_ratio))
                                     if eng_ratio else None}})
        brief = {k2: ({k3: v3 for k3, v3 in v.items() if k3 != "per_request"}
                      if isinstance(v, dict) else v) for k2, v in runs[-1].items()}
        print(json.dumps(brief, indent=2), flush=True)
    write(ns.out, {"runs": runs, "models": ns.models, "rate": ns.rate,
                   "duration_s": ns.duration, "time_scale": ns.time_scale,
                   "direct": ns.direct})


if __name__ == "__main__":
    main()
