"""Real time confirms it: ``predicted`` through ``tokengate up`` against the real
sglang-router (``cache_aware``) in front of the same reference backends, on Mooncake and
the Azure conversation trace at 65 % load, alternated over rounds, every run reported; and
the same schedules simulated, for both.

    python -m benchmarks.sim_confirm [--requests 300] [--rounds 2] [--load 0.65] [--out DIR]

sglang-router 0.3.2 (PyPI) is installed into ``.venv-peers`` the first time. Each run
starts a fresh fleet (4 reference backends: the strategy matrix's Llama-3.1-8B on H100 with
a 2,048-token step budget, ``simulator.matrix``), warms it up, and replays the trace's first
``--requests`` with its arrival times scaled to the load (the matrix's definition of load)
through tokengate, or through sglang-router started on the fleet's backends.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

from benchmarks import sim_validate as validate
from benchmarks.peer_stack import start_sglang
from loadtests import workloads
from loadtests.traces import load_azure
from simulator import matrix


def _span(trace: str, n: int) -> float:
    if trace.endswith(".jsonl"):
        rows = workloads.load_mooncake(trace, n)
        return (float(rows[-1]["timestamp"]) - float(rows[0]["timestamp"])) / 1000.0
    rows_a = load_azure(trace, limit=n)
    return rows_a[-1].t - rows_a[0].t


def case_at(name: str, n: int, load: float) -> validate.Case:
    """The trace's first ``n`` requests, its arrival times scaled to ``load``."""
    w = matrix.workloads_(n)[name]
    work, _ = matrix.offered(w)
    assert w.spec.trace is not None
    scale = work / (4 * load) / _span(w.spec.trace, n)
    shape = matrix.fleet_shape("agg", "predicted")
    return validate.Case(name, replace(w.spec, time_scale=scale), shape=shape, slo=matrix.SLO_)


def run(case: validate.Case, router: str, out: Path) -> dict[str, Any]:
    strategy = "predicted" if router == "tokengate" else "round_robin"
    with validate.fleet(case.shape, strategy, budget=matrix.BUDGET) as (base, backends):
        if router == "tokengate":
            validate.warm(base, out / "warm-up")
            return validate.loadtest(case, base, out)
        proc, sg = start_sglang(backends, out.parent / f"sglang-{os.getpid()}.log")
        try:
            validate.warm(sg, out / "warm-up")
            return validate.loadtest(case, sg, out)
        finally:
            proc.terminate()
            proc.wait(10)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--load", type=float, default=0.65)
    ap.add_argument("--workloads", default="mooncake,azure-conv")
    ap.add_argument("--out", default="/tmp/tokengate-confirm")
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in a.workloads.split(","):
        case = case_at(name, a.requests, a.load)
        for strategy in ("predicted", "sglang_cache_aware"):
            sim = validate.sim_run(case, strategy, None)
            rows.append(_row(name, "simulated", strategy, 0, sim))
            print(json.dumps(rows[-1]), flush=True)
        for k in range(a.rounds):
            order = ("tokengate", "sglang") if k % 2 == 0 else ("sglang", "tokengate")
            for router in order:
                rep = run(case, router, out / name / f"{router}-{k}")
                rows.append(_row(name, "real", router, k, rep))
                print(json.dumps(rows[-1]), flush=True)
    (out / "confirm.json").write_text(json.dumps(rows, indent=2))
    head = "| workload | run | router | round | TTFT p50 | TTFT p99 | TPOT p50 | goodput |\n" \
           "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: |\n"
    (out / "confirm.md").write_text(head + "\n".join(
        f"| {r['workload']} | {r['run']} | {r['router']} | {r['round']} | {r['ttft_p50']:,.0f} "
        f"| {r['ttft_p99']:,.0f} | {r['tpot_p50']:.1f} | {r['goodput']:.1%} |" for r in rows)
        + "\n")
    return 0


def _row(name: str, kind: str, router: str, k: int, rep: dict[str, Any]) -> dict[str, Any]:
    return {"workload": name, "run": kind, "router": router, "round": k,
            "ttft_p50": rep["ttft_ms"]["p50"], "ttft_p99": rep["ttft_ms"]["p99"],
            "tpot_p50": rep["tpot_ms"]["p50"], "goodput": rep["goodput_fraction"],
            "completed": rep["completed"], "requests": rep["requests"]}


if __name__ == "__main__":
    raise SystemExit(main())
