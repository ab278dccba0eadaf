"""``tokengate plan``: the cheapest fleet that serves a workload within its SLOs.

For a model and a GPU, the planner simulates the workload (``simulator.run``, the default
``predicted`` routing) for every tensor-parallel degree the model fits at (1, 2, 4, 8 GPUs
per replica) on aggregated pools of 1, 2, … replicas and on prefill/decode pools of every P:D
split of 2, 3, … replicas, and measures the goodput (the share of requests meeting both the TTFT and
the TPOT SLO). It recommends the layout with the fewest GPUs whose goodput reaches
``--target-goodput`` (ties: the higher goodput), and reports the Pareto table (GPUs → the best
goodput of each kind of layout) with a plot.

The search stops growing a kind of layout once it meets the target (more GPUs only cost
more) or reaches ``--max-gpus``, and never tries more GPUs than the best answer so far.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from backend.engine_config import EngineConfig, num_gpu_blocks
from loadtests.metrics import SLO
from roofline.profiles import HARDWARE, MODELS
from simulator.run import SimConfig, simulate
from simulator.workload import WorkloadSpec
from stack.pool_shape import PoolShape


@dataclass(slots=True)
class PlanConfig:
    workload: WorkloadSpec
    model: str
    hardware: str
    slo: SLO
    target_goodput: float = 0.9
    max_gpus: int = 16
    max_batched_tokens: int | None = None
    policy: str | None = None
    strategy: str = "predicted"


@dataclass(slots=True)
class Trial:
    layout: str  # "agg" or "P:D"
    tp: int  # GPUs per replica
    replicas: int
    gpus: int
    goodput: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    tpot_p50_ms: float
    tpot_p99_ms: float

    @property
    def kind(self) -> str:
        return "aggregated" if self.layout == "agg" else "disaggregated"


def _trial(cfg: PlanConfig, tp: int, backends: int | None, pd: str | None) -> Trial:
    shape = PoolShape(strategy=cfg.strategy, backends=backends, pd=pd, model=cfg.model,
                      hardware=cfg.hardware, max_batched_tokens=cfg.max_batched_tokens,
                      no_quota=True, tensor_parallel=tp)
    sim = SimConfig(cfg.workload, shape=shape, slo=cfg.slo)
    if cfg.policy is not None:
        sim = replace(sim, policy=cfg.policy)
    rep = simulate(sim).report
    n = backends if backends is not None else sum(int(x) for x in (pd or "0:0").split(":"))
    return Trial("agg" if backends is not None else str(pd), tp, n, n * tp,
                 rep["goodput_fraction"], rep["ttft_ms"]["p50"] or 0.0,
                 rep["ttft_ms"]["p99"] or 0.0, rep["tpot_ms"]["p50"] or 0.0,
                 rep["tpot_ms"]["p99"] or 0.0)


def fits(model: str, hardware: str, tp: int) -> bool:
    """Whether the model's weights leave room for a KV cache on ``tp`` GPUs."""
    m = dataclasses.replace(MODELS[model], tensor_parallel=tp)
    return num_gpu_blocks(m, HARDWARE[hardware], EngineConfig()) > 0


def search(cfg: PlanConfig, log: Any = None) -> list[Trial]:
    """Every tensor-parallel degree that fits (1, 2, 4, 8) × replicas × aggregated or P:D."""
    if cfg.model not in MODELS:
        raise ValueError(f"unknown model profile {cfg.model!r}")
    if cfg.hardware not in HARDWARE:
        raise ValueError(f"unknown hardware profile {cfg.hardware!r}")
    trials: list[Trial] = []

    def run(tp: int, backends: int | None, pd: str | None) -> Trial:
        t = _trial(cfg, tp, backends, pd)
        trials.append(t)
        if log is not None:
            log(t)
        return t

    best_gpus = cfg.max_gpus
    for tp in (t for t in (1, 2, 4, 8) if t <= cfg.max_gpus and fits(cfg.model, cfg.hardware,
                                                                     t)):
        for n in range(1, best_gpus // tp + 1):
            if run(tp, n, None).goodput >= cfg.target_goodput:
                best_gpus = min(best_gpus, n * tp)
                break
        for total in range(2, best_gpus // tp + 1):
            met = False
            for p in range(1, total):
                if run(tp, None, f"{p}:{total - p}").goodput >= cfg.target_goodput:
                    met = True
                    best_gpus = min(best_gpus, total * tp)
            if met:
                break
    return trials


def recommend(trials: list[Trial], target: float) -> Trial | None:
    ok = [t for t in trials if t.goodput >= target]
    return min(ok, key=lambda t: (t.gpus, -t.goodput)) if ok else None


def pareto(trials: list[Trial]) -> dict[str, dict[int, Trial]]:
    """Per kind of layout, per GPU count: its best trial."""
    out: dict[str, dict[int, Trial]] = {}
    for t in trials:
        best = out.setdefault(t.kind, {}).get(t.gpus)
        if best is None or t.goodput > best.goodput:
            out[t.kind][t.gpus] = t
    return out


def write(cfg: PlanConfig, trials: list[Trial], out: Path) -> Trial | None:
    out.mkdir(parents=True, exist_ok=True)
    rec = recommend(trials, cfg.target_goodput)
    rows = ["| layout | TP | replicas | GPUs | goodput | TTFT p50 / p99 (ms) | "
            "TPOT p50 / p99 (ms) |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for t in sorted(trials, key=lambda t: (t.gpus, t.tp, t.layout)):
        mark = " **(recommended)**" if t is rec else ""
        rows.append(f"| {t.layout}{mark} | {t.tp} | {t.replicas} | {t.gpus} | {t.goodput:.1%} | "
                    f"{t.ttft_p50_ms:,.0f} / {t.ttft_p99_ms:,.0f} | "
                    f"{t.tpot_p50_ms:.1f} / {t.tpot_p99_ms:.1f} |")
    front = pareto(trials)
    frows = ["| GPUs | " + " | ".join(front) + " |", "| ---: |" + " ---: |" * len(front)]
    for g in sorted({g for by in front.values() for g in by}):
        cells = []
        for by in front.values():
            b = by.get(g)
            cells.append(f"{b.goodput:.1%} ({b.layout}, TP{b.tp})" if b else "—")
        frows.append(f"| {g} | " + " | ".join(cells) + " |")
    verdict = (f"Recommended: **{rec.layout}** with {rec.replicas} replica(s) of TP{rec.tp}, "
               f"{rec.gpus} "
               f"GPU(s), goodput {rec.goodput:.1%}." if rec else
               f"No layout up to {cfg.max_gpus} GPUs reaches {cfg.target_goodput:.0%} goodput.")
    slo = f"TTFT ≤ {cfg.slo.ttft_ms} ms, TPOT ≤ {cfg.slo.tpot_ms} ms"
    (out / "plan.md").write_text(
        f"# Capacity plan: {cfg.model} on {cfg.hardware}\n\nSLO {slo}, target goodput "
        f"{cfg.target_goodput:.0%}.\n\n{verdict}\n\n## Every layout tried\n\n"
        + "\n".join(rows) + "\n\n## Pareto (GPUs → best goodput)\n\n" + "\n".join(frows) + "\n")
    (out / "plan.json").write_text(json.dumps(
        {"model": cfg.model, "hardware": cfg.hardware, "slo": {"ttft_ms": cfg.slo.ttft_ms,
                                                               "tpot_ms": cfg.slo.tpot_ms},
         "target_goodput": cfg.target_goodput,
         "recommended": None if rec is None else rec.layout,
         "recommended_gpus": None if rec is None else rec.gpus,
         "recommended_tp": None if rec is None else rec.tp,
         "trials": [{"layout": t.layout, "tp": t.tp, "replicas": t.replicas, "gpus": t.gpus,
                     "goodput": t.goodput, "ttft_p50_ms": t.ttft_p50_ms,
                     "ttft_p99_ms": t.ttft_p99_ms, "tpot_p50_ms": t.tpot_p50_ms,
                     "tpot_p99_ms": t.tpot_p99_ms} for t in trials]}, indent=2))
    fig, ax = plt.subplots(figsize=(6, 4))
    for kind, by in front.items():
        gs = sorted(by)
        ax.plot(gs, [by[g].goodput for g in gs], marker="o", label=kind)
    ax.axhline(cfg.target_goodput, color="grey", ls="--", lw=0.8, label="target")
    ax.set_xlabel("GPUs")
    ax.set_ylabel("goodput (share of requests within both SLOs)")
    ax.set_ylim(0, 1.02)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "pareto.png", dpi=110)
    plt.close(fig)
    return rec
