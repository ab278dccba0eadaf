"""Many models on the same GPUs: how many GPUs each pooling mode needs, simulated.

    python -m benchmarks.sim_models [--out DIR] [--models 8,32,128] [--duration S] [--quick]

For each N, a long tail of N models (``simulator.longtail``: Zipf popularity, bursty per-model
arrivals from the Azure conversation trace, ``RATE_PER_MODEL`` requests/s per model on
average) is served by Llama-3-8B instances on H100s (``simulator.multimodel``: the reference
backend's scheduler, memory budget and switch costs; placement by token velocity, routing by
residency). For each mode — ``dedicated`` (one model per GPU), ``request`` (switch when a
batch drains), ``token`` (switch between steps, by deadline) — the fewest GPUs holding
≥ 95 % SLO attainment (TTFT ≤ 2 s and TPOT ≤ 50 ms), found by binary search, and at that
size: goodput per GPU, switches and the time they took. A run stops as soon as more than 5 %
of its requests missed the SLO (its attainment is then an upper bound, ``stopped_early``).

``bound``: perfect foresight of arrivals: every load is started ahead of the requests that need
it and overlaps other models' steps, so it costs the GPU no time (``SwitchCost.prefetched``),
while ``token`` scheduling decides exactly as it would (it still weighs each load, and a model
switched in keeps the GPU as long): the fewest GPUs with which that holds the target. Real
switches only cost more.

Then, on the 32-model workload and the GPUs ``request`` needs there (so that ``request`` holds
the base rate), the highest arrival rate each of ``request`` and ``token`` sustains at ≥ 95 %
(rates scaled by ``FACTORS``, stopping at the first that falls short).

``--mooncake N``: instead, long prompts: the first N requests of the Mooncake synthetic trace
that ships in ``loadtests/data/traces/`` (arrivals and lengths as recorded, prompts of ~10-15K
tokens on average), spread over 32 models with Zipf(1.1) popularity, served by Llama-3.1-8B
(128K context) on H100s; ``--max-input T`` caps every prompt at T tokens (0: as recorded).

``--causes G[,G…]`` (with ``--mooncake``): instead of the search, ``token`` and the bound run
on exactly G GPUs each, to the end, and ``causes.md`` says where the requests' time went
(``simulator.causes``: switches, other models' prefill and decode steps, the own model's
queue, the own prefill; the gaps between tokens that other models' steps add; the busiest
instance over the mean), over every request and over those that missed the SLO.

``--disaggregate`` (either workload) adds ``token P/D``: token-level scheduling on separate
prefill and decode instances (Aegaeon's layout), the split searched at each size
(``fewest_gpus(split=True)``).

Every run is reported (``report.json``, ``report.md``); nothing is kept or dropped by result.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from loadtests.traces import TRACES
from roofline.profiles import HARDWARE, MODELS
from roofline.switching import SwitchCost
from simulator.longtail import ModelRequest, from_trace, longtail, zipf_models
from simulator.multimodel import FleetConfig, run_fleet
from simulator.sizing import best_per_size, fewest_gpus

MODES = ("dedicated", "request", "token")
PD = "token P/D"  # token-level on separate prefill and decode instances (--disaggregate)
RATE_PER_MODEL = 0.25  # requests/s per model, on average (Zipf: the head far more)
TARGET = 0.95
FACTORS = (0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0)


def config(mode: str, instances: int = 1, seed: int = 0, model: str = "llama-3-8b"
           ) -> FleetConfig:
    return FleetConfig(instances, mode, MODELS[model], HARDWARE["h100-sxm"],  # type: ignore[arg-type]
                       per_instance=8, seed=seed)


def bound_config(instances: int = 1, model: str = "llama-3-8b") -> FleetConfig:
    """``token`` with every switch prefetched, so free: the perfect-foresight bound."""
    cfg = config("token", instances, model=model)
    cfg.switch = SwitchCost(prefetched=True)
    return cfg


def mooncake_zipf(requests: int, max_input: int) -> list[ModelRequest]:
    """The first ``requests`` of the Mooncake synthetic trace over 32 Zipf(1.1) models."""
    reqs = zipf_models(from_trace(TRACES / "mooncake_synthetic.jsonl", "m0")[:requests], 32,
                       1.1, seed=32)
    if max_input:
        for r in reqs:
            r.prompt_tokens = min(r.prompt_tokens, max_input)
    return reqs


def sizes(n: int, duration: float, log: list[dict[str, Any]],
          reqs: list[ModelRequest] | None = None, model: str = "llama-3-8b",
          pooled_max: int | None = None, disaggregate: bool = False) -> dict[str, Any]:
    reqs = reqs if reqs is not None else longtail(n, RATE_PER_MODEL * n, duration, seed=n)
    row: dict[str, Any] = {"models": n, "requests": len(reqs)}
    # each mode's search; with ``disaggregate``, token on prefill and decode instances too
    searches = [(mode, mode, False) for mode in MODES]
    if disaggregate:
        searches.append((PD, "token", True))
    for label, mode, split in searches:
        t0 = time.perf_counter()
        best, trials = fewest_gpus(reqs, config(mode, model=model), TARGET,
                                   2 * n if mode == "dedicated" else pooled_max or n,
                                   split=split)
        for t in trials:
            log.append({"models": n, "mode": label, **t})
            bound = "<=" if t["stopped_early"] else "  "
            pre = f" ({t['prefill_instances']} prefill)" if split else ""
            misses = (f", misses: TTFT {t['ttft_misses']} ({t['ttft_misses_in_prefill']} in "
                      f"prefill), TPOT {t['tpot_misses']}" if split else "")
            print(f"  N={n} {label:9} {t['instances']:4} GPUs{pre}: attainment {bound}"
                  f"{t['attainment']:.3f} switches {t['switches']}{misses}", flush=True)
        # at the size found, the split that reached the target (one trial a size unsplit)
        at = next((t for t in best_per_size(trials) if t["instances"] == best), None)
        row[label] = {"gpus": best, "wall_s": time.perf_counter() - t0, **({
            k: at[k] for k in ("prefill_instances", "attainment",
                               "goodput_tokens_per_s_per_gpu", "switches", "switch_s",
                               "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "utilisation")}
            if at else {})}
    best, trials = fewest_gpus(reqs, bound_config(model=model), TARGET,
                               row["token"]["gpus"] or pooled_max or n)
    for t in trials:
        log.append({"models": n, "mode": "bound", **t})
    row["bound"] = {"gpus": best}
    return row


def rates(duration: float, gpus: int, log: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {"models": 32, "gpus": gpus}
    for mode in ("request", "token"):
        best = 0.0
        for f in FACTORS:
            reqs = longtail(32, RATE_PER_MODEL * 32 * f, duration, seed=32)
            s = run_fleet(reqs, config(mode, gpus), int((1 - TARGET) * len(reqs))).summary(
                2.0, 0.05)
            log.append({"models": 32, "mode": mode, "rate_factor": f, **s})
            print(f"  rate x{f} {mode:8} on {gpus} GPUs: attainment {s['attainment']:.3f}",
                  flush=True)
            if s["attainment"] >= TARGET:
                best = f
            else:
                break
        out[mode] = {"max_rate_factor": best, "max_rate_rps": best * RATE_PER_MODEL * 32}
    r = out["request"]["max_rate_factor"]
    out["token_over_request"] = out["token"]["max_rate_factor"] / r if r else None
    return out


def markdown(rows: list[dict[str, Any]], rate: dict[str, Any] | None) -> str:
    lines = ["| models | requests | mode | GPUs | attainment | goodput tok/s/GPU | switches "
             "| switch s | TTFT p50 ms | TTFT p99 ms |", "|" + "---|" * 10]
    for row in rows:
        for mode in (*MODES, PD):
            if mode not in row:
                continue
            m = row[mode]
            lines.append(
                f"| {row['models']} | {row['requests']} | {mode} | {m['gpus']} | "
                f"{m.get('attainment', float('nan')):.3f} | "
                f"{m.get('goodput_tokens_per_s_per_gpu', float('nan')):.0f} | "
                f"{m.get('switches', '')} | {m.get('switch_s', float('nan')):.1f} | "
                f"{m.get('ttft_p50_ms') or float('nan'):.0f} | "
                f"{m.get('ttft_p99_ms') or float('nan'):.0f} |")
        lines.append(f"| {row['models']} | | bound | {row['bound']['gpus']} | | | | | | |")
    for row in rows:
        d, t = row["dedicated"]["gpus"], row["token"]["gpus"]
        if d and t:
            lines.append(f"\nN={row['models']}: dedicated / token = {d / t:.2f}x GPUs")
    if rate is not None:
        lines.append(f"\nArrival rate sustained at >= {TARGET:.0%} on {rate['gpus']} GPUs, "
                     f"32 models: request x{rate['request']['max_rate_factor']}, token "
                     f"x{rate['token']['max_rate_factor']} (token/request = "
                     f"{rate['token_over_request']})")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="benchmarks/results/models")
    ap.add_argument("--models", default="8,32,128")
    ap.add_argument("--duration", type=float, default=300.0)
    ap.add_argument("--quick", action="store_true", help="8 and 32 models, 120 s")
    ap.add_argument("--mooncake", type=int, default=0, metavar="N",
                    help="instead: the first N requests of the Mooncake trace over 32 models")
    ap.add_argument("--max-input", type=int, default=32768,
                    help="with --mooncake: prompts capped at this many tokens (0: as recorded)")
    ap.add_argument("--disaggregate", action="store_true",
                    help="also token-level pooling on separate prefill and decode instances "
                    "(the split searched per size)")
    ap.add_argument("--causes", default="", metavar="G[,G]",
                    help="with --mooncake: token and the bound on these GPU counts, to the "
                         "end, and where the time went (causes.md)")
    ns = ap.parse_args()
    if ns.mooncake:
        mooncake(ns)
        return
    ns_models = [8, 32] if ns.quick else [int(x) for x in ns.models.split(",")]
    duration = 120.0 if ns.quick else ns.duration
    log: list[dict[str, Any]] = []
    rows: list[dict[str, Any]] = []
    rate: dict[str, Any] | None = None
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    for n in ns_models:
        rows.append(sizes(n, duration, log, disaggregate=ns.disaggregate))
        if n == 32 and rows[-1]["request"]["gpus"]:
            rate = rates(duration, rows[-1]["request"]["gpus"], log)
        # written after each size: a long run that is stopped keeps what it measured
        (out / "report.json").write_text(json.dumps(
            {"rows": rows, "rates": rate, "runs": log, "duration_s": duration,
             "rate_per_model": RATE_PER_MODEL, "target": TARGET}, indent=2) + "\n")
        md = markdown(rows, rate)
        (out / "report.md").write_text(md)
    print(md)


def causes(reqs: list[ModelRequest], gpus: list[int], model: str, out: Path) -> None:
    """``token`` and the bound on each of ``gpus``, to the end: where the time went."""
    rows: list[dict[str, Any]] = []
    for n in gpus:
        for mode in ("token", "bound"):
            cfg = bound_config(n, model) if mode == "bound" else config("token", n, model=model)
            s = run_fleet(reqs, cfg).summary(2.0, 0.05)
            rows.append({"gpus": n, "mode": mode, **s})
            print(f"  {mode:5} {n:3} GPUs: attainment {s['attainment']:.3f}", flush=True)
    head = ("switch", "other_prefill", "other_decode", "own_queue", "own_prefill")
    lines = ["| GPUs | mode | attainment | requests | " + " | ".join(head) +
             " | TPOT: other models per token | busiest / mean |",
             "|---|---|---|---|" + "---:|" * (len(head) + 2)]
    for r in rows:
        for who in ("all", "missed"):
            c = r["causes_ms"][who]
            if not c:
                continue
            n = r["requests"] if who == "all" else r["causes_ms"]["missed_requests"]
            lines.append(f"| {r['gpus']} | {r['mode']} | {r['attainment']:.3f} | {who} ({n}) | "
                         + " | ".join(f"{c[k]:,.0f}" for k in head)
                         + f" | {c['decode_other_per_token']:.1f} | "
                         f"{r['busy_max_over_mean']:.2f} |")
    md = ("Mean ms per request by cause (TTFT), and the decode gap other models add per "
          "token (ms):\n\n" + "\n".join(lines) + "\n")
    out.mkdir(parents=True, exist_ok=True)
    (out / "causes.json").write_text(json.dumps(rows, indent=2) + "\n")
    (out / "causes.md").write_text(md)
    print(md)


def mooncake(ns: argparse.Namespace) -> None:
    """The long-prompt workload: dedicated, request, token and the bound on the same requests,
    and how many prompts could not meet the TTFT SLO even alone on an idle GPU."""
    from roofline.timing import TimingModel

    reqs = mooncake_zipf(ns.mooncake, ns.max_input)
    if ns.causes:
        causes(reqs, [int(g) for g in ns.causes.split(",")], "llama-3.1-8b", Path(ns.out))
        return
    tm = TimingModel(MODELS["llama-3.1-8b"], HARDWARE["h100-sxm"], jitter=0.0)
    alone = sum(tm.prefill_seconds(r.prompt_tokens, 8192) > 2.0 for r in reqs) / len(reqs)
    print(f"{len(reqs)} requests, mean prompt {sum(r.prompt_tokens for r in reqs) / len(reqs):,.0f}"
          f" tokens; {alone:.1%} cannot meet a 2 s TTFT even alone on an idle GPU", flush=True)
    log: list[dict[str, Any]] = []
    row = sizes(32, 0.0, log, reqs, "llama-3.1-8b", pooled_max=64,
                disaggregate=ns.disaggregate)
    row["alone_over_slo"] = alone
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(
        {"workload": "mooncake-zipf", "max_input": ns.max_input, "rows": [row], "runs": log,
         "target": TARGET}, indent=2) + "\n")
    md = markdown([row], None)
    (out / "report.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
