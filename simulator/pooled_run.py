"""``tokengate simulate --pooling`` and ``tokengate plan --pooling``: many models on a shared
fleet (``simulator.multimodel``), from a generated long tail or a JSONL trace naming a model
per row. ``simulate`` writes ``report.json`` (the fleet's figures and one row per model);
``plan`` writes ``plan.json`` with ``recommended_gpus``, the fewest GPUs whose SLO attainment
reaches ``--target-goodput``, ``bound_gpus``, the fewest with perfect foresight (every switch
prefetched, so free, with ``token`` scheduling on instances that do both phases), every size it
tried, and ``plan.md`` with their table and ``plan.png``. With ``--disaggregate`` it also
searches fleets split into prefill and decode instances (``disaggregated_gpus``, its trials
with their splits) and recommends the fewer GPUs of the two ``layout``s."""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from roofline.profiles import ProfileCatalog
from roofline.switching import SwitchCost
from simulator.longtail import ModelRequest, from_trace, longtail
from simulator.multimodel import FleetConfig, FleetResult, run_fleet
from simulator.sizing import best_per_size, fewest_gpus


def workload(ns: argparse.Namespace, model: str) -> list[ModelRequest]:
    if bool(ns.longtail) == bool(ns.trace):
        raise ValueError("--pooling needs exactly one of --longtail N and --trace FILE.jsonl")
    if ns.longtail:
        if ns.duration is None:
            raise ValueError("--longtail needs --duration (seconds of arrivals)")
        return longtail(ns.longtail, ns.rate, ns.duration, zipf_s=ns.zipf, seed=ns.seed,
                        max_input=ns.max_input or 8192)
    reqs = from_trace(ns.trace, model)
    if ns.requests:
        reqs = reqs[:ns.requests]
    return reqs


def fleet_config(ns: argparse.Namespace, model: str, hardware: str, instances: int,
                 prefill: int = 0) -> FleetConfig:
    catalog = ProfileCatalog()
    return FleetConfig(
        instances, ns.pooling, catalog.get_model(model), catalog.get_hardware(hardware),
        per_instance=ns.models_per_gpu,
        switch=SwitchCost(source=ns.weights_from, optimised=not ns.naive_switch),
        ttft_slo_s=(ns.slo_ttft_ms or 2000.0) / 1e3, tpot_slo_s=(ns.slo_tpot_ms or 50.0) / 1e3,
        max_num_batched_tokens=ns.max_batched_tokens or 8192, jitter=ns.jitter,
        seed=ns.seed, prefill_instances=prefill)


def per_model(res: FleetResult, ttft_s: float, tpot_s: float) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for r in res.requests:
        row = out.setdefault(r.model, {"requests": 0, "met": 0, "instances": 0})
        row["requests"] += 1
        row["met"] += r.meets(ttft_s, tpot_s)
    for hosts in res.hosts:
        for m in hosts:
            if m in out:
                out[m]["instances"] += 1
    for row in out.values():
        row["attainment"] = row["met"] / row["requests"]
    return out


def simulate(ns: argparse.Namespace) -> dict[str, Any]:
    model = ns.backend_model or "llama-3-8b"
    hardware = ns.hardware or "h100-sxm"
    reqs = workload(ns, model)
    cfg = fleet_config(ns, model, hardware, ns.backends or 1, ns.prefill_instances)
    wall = time.perf_counter()
    res = run_fleet(reqs, cfg)
    rep = res.summary(cfg.ttft_slo_s, cfg.tpot_slo_s)
    rep.update(pooling=cfg.mode, model=model, hardware=hardware,
               models=len({r.model for r in reqs}), gpus=res.gpus, wall_s=time.perf_counter()
               - wall, virtual_s=res.virtual_s, placement=res.hosts,
               per_model=per_model(res, cfg.ttft_slo_s, cfg.tpot_slo_s))
    return rep


def plan(ns: argparse.Namespace,
         log: Callable[[str, dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """The fewest GPUs for ``--pooling`` and, beside it, the perfect-foresight bound on the
    same requests; ``log(mode, trial)`` hears of each trial as it ends."""
    reqs = workload(ns, ns.model)
    base = fleet_config(ns, ns.model, ns.hardware, 1)
    best, trials = fewest_gpus(reqs, base, ns.target_goodput, ns.max_gpus,
                               None if log is None else lambda t: log(ns.pooling, t))
    layout, agg = "aggregated", best
    split: dict[str, Any] = {}
    if ns.disaggregate:
        pd, pd_trials = fewest_gpus(reqs, base, ns.target_goodput, ns.max_gpus,
                                    None if log is None else lambda t: log("P/D", t),
                                    split=True)
        if pd is not None and (best is None or pd < best):
            layout, best = "disaggregated", pd
        split = {"aggregated_gpus": _gpus(agg, base), "disaggregated_gpus": _gpus(pd, base),
                 "disaggregated_trials": sorted(pd_trials, key=lambda t: (
                     t["instances"], t["prefill_instances"]))}
    free = dataclasses.replace(base, mode="token", switch=SwitchCost(prefetched=True))
    bound, bound_trials = fewest_gpus(reqs, free, ns.target_goodput, agg or ns.max_gpus,
                                      None if log is None else lambda t: log("bound", t))
    return {"pooling": ns.pooling, "model": ns.model, "hardware": ns.hardware,
            "models": len({r.model for r in reqs}), "requests": len(reqs),
            "target_goodput": ns.target_goodput,
            "slo": {"ttft_ms": base.ttft_slo_s * 1e3, "tpot_ms": base.tpot_slo_s * 1e3},
            "recommended_gpus": _gpus(best, base), "recommended_instances": best,
            "layout": layout,
            "recommended_prefill_instances": next(
                (t["prefill_instances"] for t in split.get("disaggregated_trials", ())
                 if t["instances"] == best and _passes(t, ns.target_goodput)), 0)
            if layout == "disaggregated" else 0,
            "bound_gpus": _gpus(bound, base),
            "trials": sorted(trials, key=lambda t: t["instances"]),
            "bound_trials": sorted(bound_trials, key=lambda t: t["instances"]), **split}


def _passes(trial: dict[str, Any], target: float) -> bool:
    """Did ``trial`` run to the end and reach ``target``?"""
    return not trial["stopped_early"] and trial["attainment"] >= target


def _gpus(instances: int | None, cfg: FleetConfig) -> int | None:
    return None if instances is None else instances * max(cfg.profile.tensor_parallel, 1)


def attainment_text(t: dict[str, Any]) -> str:
    """A trial's attainment as it may be read: a trial stopped once too many requests had
    missed the SLO did not finish, and says so (what it could at most have reached)."""
    if t["stopped_early"]:
        return f"stopped early (at most {t['attainment']:.1%})"
    return f"{t['attainment']:.1%}"


def _n(gpus: int | None) -> str:
    return "more than were tried" if gpus is None else f"{gpus} GPU(s)"


def _ms(v: float | None) -> str:
    return "—" if v is None else f"{v:,.0f}"


def plan_markdown(doc: dict[str, Any]) -> str:
    mode, rec, bound = doc["pooling"], doc["recommended_gpus"], doc["bound_gpus"]
    slo = doc["slo"]
    verdict = (f"Recommended: **{rec} GPU(s)** with `{mode}` pooling." if rec is not None
               else f"No fleet tried reached {doc['target_goodput']:.0%} with `{mode}` "
               "pooling.")
    if bound is not None:
        verdict += f" Perfect-foresight bound: **{bound} GPU(s)**"
        verdict += f" ({rec / bound:.2f}× the bound)." if rec else "."
    if "disaggregated_gpus" in doc:
        verdict += (f" Instances that do both phases need {_n(doc['aggregated_gpus'])}, "
                    f"prefill and decode instances {_n(doc['disaggregated_gpus'])}"
                    + (f" ({doc['recommended_prefill_instances']} prefill)"
                       if doc["layout"] == "disaggregated" else "") + ".")
    rows = ["| mode | instances | prefill | GPUs | attainment | TTFT p50 / p99 (ms) | "
            "TPOT p50 (ms) | switches | utilisation |",
            "| --- | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: |"]
    pd = f"{mode}, prefill/decode"
    for label, trials in ((mode, doc["trials"]), (pd, doc.get("disaggregated_trials", [])),
                          ("bound", doc["bound_trials"])):
        for t in trials:
            mine = label == {"aggregated": mode, "disaggregated": pd}[doc["layout"]]
            mark = " **(recommended)**" if mine and t["gpus"] == rec \
                and t["prefill_instances"] == doc["recommended_prefill_instances"] \
                and _passes(t, doc["target_goodput"]) else ""
            rows.append(f"| {label}{mark} | {t['instances']} | "
                        f"{t['prefill_instances'] or '—'} | {t['gpus']} | "
                        f"{attainment_text(t)} | {_ms(t['ttft_p50_ms'])} / "
                        f"{_ms(t['ttft_p99_ms'])} | {_ms(t['tpot_p50_ms'])} | {t['switches']} | "
                        f"{t['utilisation']:.2f} |")
    return (f"# Capacity plan: {doc['models']} models of {doc['model']} on {doc['hardware']}, "
            f"`{mode}` pooling\n\n{doc['requests']} requests; SLO TTFT ≤ {slo['ttft_ms']:g} ms "
            f"and TPOT ≤ {slo['tpot_ms']:g} ms for {doc['target_goodput']:.0%} of them.\n\n"
            f"{verdict}\n\nThe bound serves the same requests with `token` scheduling and every "
            "model switch prefetched ahead of the requests that need it, so free: no real fleet "
            "needs fewer GPUs. A trial stops once more requests have missed the SLO than the "
            "target allows; its attainment is then the most it could have reached.\n\n"
            "## Every size tried\n\n" + "\n".join(rows) + "\n")


def write_plan(out: Path, doc: dict[str, Any]) -> Path:
    """``plan.json``, ``plan.md`` and ``plan.png`` (attainment against GPUs, mode and bound)
    in ``out``; the path of ``plan.json``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = write(out, "plan.json", doc)
    (out / "plan.md").write_text(plan_markdown(doc))
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, trials in ((doc["pooling"], doc["trials"]),
                          (f"{doc['pooling']}, prefill/decode (best split per size)", best_per_size(
                              doc.get("disaggregated_trials", []))),
                          ("bound", doc["bound_trials"])):
        if not trials:
            continue
        done = [t for t in trials if not t["stopped_early"]]
        cut = [t for t in trials if t["stopped_early"]]
        line = ax.plot([t["gpus"] for t in done], [t["attainment"] for t in done], marker="o",
                       ls="-" if done else "none", label=label)
        ax.plot([t["gpus"] for t in cut], [t["attainment"] for t in cut], marker="v",
                ls="none", color=line[0].get_color(), fillstyle="none",
                label=f"{label}, stopped early (at most)" if cut else None)
    ax.axhline(doc["target_goodput"], color="grey", ls="--", lw=0.8, label="target")
    ax.set_xlabel("GPUs")
    ax.set_ylabel("SLO attainment")
    ax.set_ylim(0, 1.02)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "plan.png", dpi=110)
    plt.close(fig)
    return path


def write(out: Path, name: str, doc: dict[str, Any]) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / name
    path.write_text(json.dumps(doc, indent=2, sort_keys=False) + "\n")
    return path


def summary_line(rep: dict[str, Any], keys: Sequence[str] = ("attainment", "ttft_p50_ms",
                 "ttft_p99_ms", "tpot_p50_ms", "switches", "utilisation")) -> str:
    parts = []
    for k in keys:
        v = rep.get(k)
        parts.append(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}")
    return ", ".join(parts)
