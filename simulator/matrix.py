"""The strategy matrix: every routing strategy on workloads × load × burstiness × pool shape,
in the simulator, read against the hindsight oracle and the clairvoyant floor.

    python -m simulator.matrix [--requests 300] [--workloads ...] [--loads 0.4,0.65,0.85]
        [--burstiness 1,0.5] [--pools agg,pd] [--strategies ...] [--seeds 7,8,9] [--out DIR]

Workloads (``WORKLOADS``): the Mooncake synthetic trace, the Azure 2023 conversation and code
traces, and agent sessions (100:1 input:output, contexts growing to ~100K tokens). A trace's
lengths and prefix structure are kept and its arrivals re-drawn with gamma gaps (shape 1 is
Poisson, 0.5 bursty) at the rate that gives the target load. *Load* is offered work over
capacity: per request, the lone prefill of the tokens no earlier request computed (ideal
reuse) plus its output at the decode cost per token of a 32-sequence batch, summed, over
endpoints × the schedule's span. Fleet: 4 Llama-3.1-8B (128K context) on H100 with a
2,048-token step budget, aggregated or 2 prefill + 2 decode. SLO: TTFT 2 s, TPOT 50 ms.

Writes ``matrix.jsonl`` (one line per run, as it goes), ``matrix.md`` (per cell, each
strategy's TTFT p50/p99 and goodput, the best marked) and ``matrix.png``.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from loadtests import workloads
from loadtests.metrics import SLO
from loadtests.traces import TRACES
from roofline.profiles import HARDWARE, MODELS
from roofline.timing import TimingModel
from simulator.oracle import clairvoyant_floor
from simulator.run import SimConfig, simulate
from simulator.workload import WorkloadSpec
from stack.pool_shape import PoolShape

MODEL, HARDWARE_NAME, BUDGET = "llama-3.1-8b", "h100-sxm", 2048
STRATEGIES = ("round_robin", "least_request", "prefix", "predicted", "sglang_cache_aware",
              "llm_d", "dynamo_kv", "hindsight")
SLO_ = SLO(2000.0, 50.0)


@dataclass(frozen=True, slots=True)
class Workload:
    name: str
    spec: WorkloadSpec


def workloads_(n: int) -> dict[str, Workload]:
    agent = workloads.SessionSpec(
        sessions=max(n // 15, 2), turns=15, agent_types=4, system_tokens=8000,
        task_tokens=500, tool_tokens=6000,
        output=workloads.parse_lengths("uniform:40:100", "output"), think_time_s=2.0)
    return {
        "mooncake": Workload("mooncake", WorkloadSpec(
            "trace", str(TRACES / "mooncake_synthetic.jsonl"), requests=n)),
        "azure-conv": Workload("azure-conv", WorkloadSpec(
            "trace", str(TRACES / "azure_llm_2023_conv.csv"), requests=n)),
        "azure-code": Workload("azure-code", WorkloadSpec(
            "trace", str(TRACES / "azure_llm_2023_code.csv"), requests=n)),
        "agent": Workload("agent", WorkloadSpec("sessions", requests=n, rate=0.1,
                                                sessions=agent, seed=3)),
    }


def fleet_shape(pool: str, strategy: str) -> PoolShape:
    return PoolShape(strategy="round_robin" if strategy == "hindsight" else strategy,
                     backends=4 if pool == "agg" else None, pd="2:2" if pool == "pd" else None,
                     model=MODEL, hardware=HARDWARE_NAME, max_batched_tokens=BUDGET,
                     no_quota=True)


def offered_work_s(hashes_prompts: Sequence[tuple[Sequence[int], int]],
                   outputs: Sequence[int]) -> float:
    timing = TimingModel(MODELS[MODEL], HARDWARE[HARDWARE_NAME], jitter=0.0)
    prefill = sum(clairvoyant_floor(timing, BUDGET, 16, hashes_prompts))
    ctx = sum(p for _, p in hashes_prompts) / max(len(hashes_prompts), 1)
    per_token = timing.decode_step_seconds(32, int(ctx)) / 32
    return prefill + per_token * sum(outputs)


def offered(w: Workload) -> tuple[float, int]:
    """The workload's offered work (s) and request count, from one round-robin run."""
    res = simulate(SimConfig(w.spec, shape=fleet_shape("agg", "round_robin"), slo=SLO_))
    reqs = res.requests
    return offered_work_s([(r.hashes, len(r.prompt_ids)) for r in reqs],
                          [r.output_tokens for r in reqs]), len(reqs)


def _retimed(w: Workload, load: float, burstiness: float
             ) -> tuple[WorkloadSpec, tuple[float, float, int] | None]:
    """The workload at ``load`` with gamma(``burstiness``) arrivals: a trace's arrivals are
    re-drawn at the rate that gives it; sessions start at such a rate (each lasting about
    turns × think time)."""
    work, n = offered(w)
    span = work / (4 * load)
    if w.spec.kind == "sessions":
        s = w.spec.sessions
        assert s is not None
        rate = s.sessions / max(span - s.turns * s.think_time_s, 1.0)
        return replace(w.spec, rate=rate, burstiness=burstiness), None
    return w.spec, (n / span, burstiness, 7)


def run_cell(w: Workload, load: float, burst: float, pool: str, strategy: str,
             spec: WorkloadSpec, retime: tuple[float, float, int] | None) -> dict[str, Any]:
    cfg = SimConfig(spec, shape=fleet_shape(pool, strategy), slo=SLO_,
                    hindsight=strategy == "hindsight", retime=retime)
    rep = simulate(cfg).report
    sim = rep["simulation"]
    return {"workload": w.name, "load": load, "burstiness": burst, "pool": pool,
            "strategy": strategy, "ttft_p50": rep["ttft_ms"]["p50"],
            "ttft_p99": rep["ttft_ms"]["p99"], "tpot_p50": rep["tpot_ms"]["p50"],
            "tpot_p99": rep["tpot_ms"]["p99"], "goodput": rep["goodput_fraction"],
            "completed": rep["completed"], "requests": rep["requests"],
            "floor_ttft_p50": sim["clairvoyant_floor"].get("ttft_p50_ms"),
            "predictor_ttft_mape": (sim["predictor"]["ttft_from_first"] or {}).get("mape"),
            "predictor_tpot_mape": (sim["predictor"]["tpot_from_first"] or {}).get("mape"),
            "busy": sum(e["busy"] for e in sim["engines"].values()) / len(sim["engines"]),
            "wall_s": sim["wall_s"], "virtual_s": sim["virtual_s"]}


def _seeded(spec: WorkloadSpec, retime: tuple[float, float, int] | None, seeds: str | None
            ) -> list[tuple[int | None, WorkloadSpec, tuple[float, float, int] | None]]:
    """The cell's workload once (``seeds`` None), or once per seed."""
    if seeds is None:
        return [(None, spec, retime)]
    out: list[tuple[int | None, WorkloadSpec, tuple[float, float, int] | None]] = []
    for seed in (int(x) for x in seeds.split(",")):
        if retime is None:
            out.append((seed, replace(spec, seed=seed), None))
        else:
            out.append((seed, spec, (retime[0], retime[1], seed)))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--workloads", default="mooncake,azure-conv,azure-code,agent")
    ap.add_argument("--loads", default="0.4,0.65,0.85")
    ap.add_argument("--burstiness", default="1,0.5")
    ap.add_argument("--pools", default="agg,pd")
    ap.add_argument("--strategies", default=",".join(STRATEGIES))
    ap.add_argument("--seeds", default=None,
                    help="comma-separated: run each cell once per seed (a trace's arrival "
                         "draw, the sessions' generator) to see a cell's own noise")
    ap.add_argument("--out", default="/tmp/tokengate-matrix")
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    lines = out / "matrix.jsonl"
    lines.write_text("")
    wl = workloads_(a.requests)
    for name in a.workloads.split(","):
        w = wl[name]
        for load in (float(x) for x in a.loads.split(",")):
            for burst in (float(x) for x in a.burstiness.split(",")):
                spec, retime = _retimed(w, load, burst)
                for seed, sp, rt in _seeded(spec, retime, a.seeds):
                    for pool in a.pools.split(","):
                        for strategy in a.strategies.split(","):
                            if strategy == "hindsight" and pool == "pd":
                                continue
                            row = run_cell(w, load, burst, pool, strategy, sp, rt)
                            if seed is not None:
                                row["seed"] = seed
                            rows.append(row)
                            with lines.open("a") as f:
                                f.write(json.dumps(row) + "\n")
                            print(json.dumps(row), flush=True)
    from simulator.matrix_report import write

    write(rows, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
