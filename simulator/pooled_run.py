"""``tokengate simulate --pooling`` and ``tokengate plan --pooling``: many models on a shared
fleet (``simulator.multimodel``), from a generated long tail or a JSONL trace naming a model
per row. ``simulate`` writes ``report.json`` (the fleet's figures and one row per model);
``plan`` writes ``plan.json`` with ``recommended_gpus``, the fewest GPUs whose SLO attainment
reaches ``--target-goodput``, and every layout it tried."""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from roofline.profiles import ProfileCatalog
from roofline.switching import SwitchCost
from simulator.longtail import ModelRequest, from_jsonl, longtail
from simulator.multimodel import FleetConfig, FleetResult, fewest_gpus, run_fleet


def workload(ns: argparse.Namespace, model: str) -> list[ModelRequest]:
    if bool(ns.longtail) == bool(ns.trace):
        raise ValueError("--pooling needs exactly one of --longtail N and --trace FILE.jsonl")
    if ns.longtail:
        if ns.duration is None:
            raise ValueError("--longtail needs --duration (seconds of arrivals)")
        return longtail(ns.longtail, ns.rate, ns.duration, zipf_s=ns.zipf, seed=ns.seed,
                        max_input=ns.max_input or 8192)
    reqs = from_jsonl(ns.trace, model)
    if ns.requests:
        reqs = reqs[:ns.requests]
    return reqs


def fleet_config(ns: argparse.Namespace, model: str, hardware: str, instances: int
                 ) -> FleetConfig:
    catalog = ProfileCatalog()
    return FleetConfig(
        instances, ns.pooling, catalog.get_model(model), catalog.get_hardware(hardware),
        per_instance=ns.models_per_gpu,
        switch=SwitchCost(source=ns.weights_from, optimised=not ns.naive_switch),
        ttft_slo_s=(ns.slo_ttft_ms or 2000.0) / 1e3, tpot_slo_s=(ns.slo_tpot_ms or 50.0) / 1e3,
        max_num_batched_tokens=ns.max_batched_tokens or 8192, jitter=ns.jitter,
        seed=ns.seed)


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
    cfg = fleet_config(ns, model, hardware, ns.backends or 1)
    wall = time.perf_counter()
    res = run_fleet(reqs, cfg)
    rep = res.summary(cfg.ttft_slo_s, cfg.tpot_slo_s)
    rep.update(pooling=cfg.mode, model=model, hardware=hardware,
               models=len({r.model for r in reqs}), gpus=res.gpus, wall_s=time.perf_counter()
               - wall, virtual_s=res.virtual_s, placement=res.hosts,
               per_model=per_model(res, cfg.ttft_slo_s, cfg.tpot_slo_s))
    return rep


def plan(ns: argparse.Namespace, log: Any = None) -> dict[str, Any]:
    reqs = workload(ns, ns.model)
    base = fleet_config(ns, ns.model, ns.hardware, 1)
    best, trials = fewest_gpus(reqs, base, ns.target_goodput, ns.max_gpus, log)
    tp = max(base.profile.tensor_parallel, 1)
    return {"pooling": ns.pooling, "model": ns.model, "hardware": ns.hardware,
            "models": len({r.model for r in reqs}), "requests": len(reqs),
            "target_goodput": ns.target_goodput,
            "slo": {"ttft_ms": base.ttft_slo_s * 1e3, "tpot_ms": base.tpot_slo_s * 1e3},
            "recommended_gpus": None if best is None else best * tp,
            "recommended_instances": best,
            "trials": sorted(trials, key=lambda t: t["instances"])}


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
