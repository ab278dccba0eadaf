"""Tenants sharing a saturated pool: a noisy neighbour, simulated.

    python -m benchmarks.sim_fairness [--out DIR] [--duration S] [--seeds N]
        [--tpot-threshold-ms MS] [--modes fcfs,priority,llm-d,fair,fair+engine]

Three tenants on two Llama-3-8B instances (H100, the demo policy's pool), each with Azure
conversation arrivals (``simulator.fairness``): B and C at ``LIGHT`` requests/s, A at ten times
its normal ``NORMAL`` (the flood). Modes, each the gateway's own flow control on the simulator's
clock:

* ``fcfs``: no gateway queue, the engines' own first-come order (tokengate before flow
  control);
* ``priority``: bands only (every tenant is ``standard`` here, so arrival order in the gateway);
* ``llm-d``: a re-implementation of llm-d's flow-control defaults: round-robin between flows
  within a band, saturation at a queue depth of 5 or KV at 0.8;
* ``fair``: VTC fair share, saturation at a queue depth of 1 or a decode step of 40 ms
  (0.8 x the 50 ms TPOT SLO);
* ``fair+engine``: ``fair`` with ``engine_priority``: the engines run vLLM's priority policy
  and a backlogged flow's requests go behind the others' in the engine's own queue.

``alone``: B by itself, the very same requests (a tenant's arrivals and prompts depend on its
name only), the reference its service under the flood is compared with. The SLO is
TTFT 2 s and TPOT 50 ms. A second scenario floods from two tenants (A and D at the same rate)
and measures the largest weighted-service difference between them over any stretch both were
backlogged, against VTC's bound 2·(w_in·L_in + w_out·L_out).

``report.json`` has, per mode: ``victim_ttft_p90_ms``, ``victim_ttft_p99_ms``,
``victim_goodput``, ``flooder_tokens_per_s``, ``utilisation``; every run is reported.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path
from typing import Any

from gateway.config.flow import FlowControl
from gateway.flow.control import TICK_S
from simulator.fairness import Tenant, noisy_neighbour

LIGHT = 2.0  # requests/s of B and C
NORMAL = 5.0  # A's normal rate; it floods at ten times that
MODES: dict[str, tuple[str, FlowControl | None]] = {
    "fcfs": ("fcfs", None),
    "priority": ("priority", FlowControl(mode="priority")),
    "llm-d": ("round_robin", FlowControl(mode="round_robin", queue_depth=5, kv_threshold=0.8)),
    "fair": ("fair", FlowControl(mode="fair", queue_depth=1, tpot_threshold_ms=40.0)),
    "fair+engine": ("fair", FlowControl(mode="fair", queue_depth=1, tpot_threshold_ms=40.0,
                                        engine_priority=True)),
    "fair+isolation": ("fair", FlowControl(mode="fair", queue_depth=1, tpot_threshold_ms=40.0,
                                           isolation_step_ms=25.0)),
}


def row(r: dict[str, Any], victim: str = "B", flooder: str = "A") -> dict[str, Any]:
    v = r["tenants"][victim]
    f = r["tenants"].get(flooder, {})
    return {"victim_ttft_p50_ms": v["ttft_p50_ms"], "victim_ttft_p90_ms": v["ttft_p90_ms"],
            "victim_ttft_p99_ms": v["ttft_p99_ms"], "victim_goodput": v["goodput"],
            "victim_refused": v["refused"], "flooder_tokens_per_s": f.get("tokens_per_s", 0.0),
            "flooder_goodput": f.get("goodput"), "utilisation": r["utilisation"],
            "victim_gateway_wait_ms": v["gateway_wait_ms"],
            "victim_engine_queue_ms": v["engine_queue_ms"], "victim_prefill_ms": v["prefill_ms"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="benchmarks/results/fairness")
    ap.add_argument("--duration", type=float, default=120.0)
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--tpot-threshold-ms", type=float, default=40.0,
                    help="the fair modes' tpot_threshold_ms (what A's batch is held to)")
    ap.add_argument("--modes", default=",".join(MODES),
                    help="comma-separated: which of " + ", ".join(MODES))
    ns = ap.parse_args()
    modes = {k: (mode, cfg if cfg is None or cfg.mode != "fair" else
                 dataclasses.replace(cfg, tpot_threshold_ms=ns.tpot_threshold_ms))
             for k, (mode, cfg) in MODES.items() if k in ns.modes.split(",")}
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    runs: list[dict[str, Any]] = []
    flood = [Tenant("A", NORMAL * 10), Tenant("B", LIGHT), Tenant("C", LIGHT)]
    for seed in range(ns.seeds):
        t0 = time.perf_counter()
        alone = noisy_neighbour([Tenant("B", LIGHT)], "fcfs", ns.duration, seed=seed)
        runs.append({"seed": seed, "mode": "alone", **row(alone),
                     "wall_s": time.perf_counter() - t0})
        for label, (mode, cfg) in modes.items():
            t0 = time.perf_counter()
            r = noisy_neighbour(flood, mode, ns.duration, seed=seed, flow=cfg)
            runs.append({"seed": seed, "mode": label, **row(r),
                         "wall_s": time.perf_counter() - t0})
            print(json.dumps(runs[-1]), flush=True)
        two = [Tenant("A", NORMAL * 10), Tenant("D", NORMAL * 10), Tenant("B", LIGHT)]
        r = noisy_neighbour(two, "fair", ns.duration, seed=seed,
                            flow=modes.get("fair", MODES["fair"])[1])
        runs.append({"seed": seed, "mode": "fair:two-flooders", "service_gap": r["service_gap"],
                     "vtc_bound": r["vtc_bound"], "flows": r["service_gap_flows"],
                     **row(r)})
        print(json.dumps(runs[-1]), flush=True)
        runs += isolation(ns.duration, seed, modes)
        # a reserved tenant idle for the first half returns into the flood
        r_tenant = Tenant("R", LIGHT, band="reserved", start=ns.duration / 2)
        r_alone = noisy_neighbour([r_tenant], "fcfs", ns.duration, seed=seed)
        r = noisy_neighbour([*flood, r_tenant], "fair", ns.duration, seed=seed,
                            flow=modes.get("fair", MODES["fair"])[1])
        runs.append({"seed": seed, "mode": "fair:reserved-returns",
                     "first_gateway_wait_ms": r["tenants"]["R"]["first_gateway_wait_ms"],
                     "decision_interval_ms": TICK_S * 1e3,
                     "alone_ttft_p90_ms": r_alone["tenants"]["R"]["ttft_p90_ms"],
                     **row(r, victim="R")})
        print(json.dumps(runs[-1]), flush=True)
    (out / "report.json").write_text(json.dumps({"runs": runs, "light_rps": LIGHT,
                                                 "flood_rps": NORMAL * 10,
                                                 "duration_s": ns.duration}, indent=1))
    (out / "report.md").write_text(markdown(runs))
    print(markdown(runs))


def isolation(duration: float, seed: int,
              modes: dict[str, tuple[str, FlowControl | None]]) -> list[dict[str, Any]]:
    """The isolation target: two tenants share the pool; B, the victim, sends half its fair
    share (a quarter of the pool's capacity in requests/s, measured by a flood of A alone);
    A sends exactly its fair share, then ten times it. B's TTFT under the flood is compared
    with its TTFT when A keeps to its share (same engines, same B requests)."""
    cap = noisy_neighbour([Tenant("A", NORMAL * 10)], "fair", duration, seed=seed,
                          flow=MODES["fair"][1])
    capacity = cap["tenants"]["A"]["served_per_s"]
    share = capacity / 2
    out = []
    for label, (mode, cfg) in modes.items():
        t0 = time.perf_counter()
        at = noisy_neighbour([Tenant("A", share), Tenant("B", share / 2)], mode, duration,
                             seed=seed, flow=cfg)
        flood = noisy_neighbour([Tenant("A", share * 10), Tenant("B", share / 2)], mode,
                                duration, seed=seed, flow=cfg)
        base = at["tenants"]["B"]
        r: dict[str, Any] = {"seed": seed, "mode": f"isolation:{label}", "capacity_rps": capacity,
             "share_rps": share, **row(flood),
             "victim_at_fair_share_ttft_p50_ms": base["ttft_p50_ms"],
             "victim_at_fair_share_ttft_p90_ms": base["ttft_p90_ms"],
             "victim_at_fair_share_ttft_p99_ms": base["ttft_p99_ms"],
             "victim_at_fair_share_goodput": base["goodput"],
             "utilisation_at_fair_share": at["utilisation"],
             "wall_s": time.perf_counter() - t0}
        r["p90_ratio"] = r["victim_ttft_p90_ms"] / max(base["ttft_p90_ms"], 1e-9)
        r["p99_ratio"] = r["victim_ttft_p99_ms"] / max(base["ttft_p99_ms"], 1e-9)
        if cfg is not None and cfg.mode == "fair":
            # the same flood with a new x-fairness-id on every request: B's figures move by
            rot = noisy_neighbour([Tenant("A", share * 10, rotate_ids=True),
                                   Tenant("B", share / 2)], mode, duration, seed=seed,
                                  flow=cfg)["tenants"]["B"]
            for q in ("p50", "p90", "p99"):
                r[f"rotating_ids_ttft_{q}_ms"] = rot[f"ttft_{q}_ms"]
                r[f"rotating_ids_change_{q}"] = rot[f"ttft_{q}_ms"] / max(
                    r[f"victim_ttft_{q}_ms"], 1e-9) - 1.0
            r["rotating_ids_goodput"] = rot["goodput"]
        print(json.dumps(r), flush=True)
        out.append(r)
    return out


def markdown(runs: list[dict[str, Any]]) -> str:
    lines = ["| seed | mode | B TTFT p50 ms | B TTFT p90 ms | B TTFT p99 ms | B goodput | "
             "B refused | A tokens/s | utilisation | B mean ms: gateway wait / engine queue / "
             "prefill |", "|" + "---|" * 10]
    for r in runs:
        if r["mode"].startswith(("fair:", "isolation:")):
            continue
        lines.append(f"| {r['seed']} | {r['mode']} | {r['victim_ttft_p50_ms']:.0f} | "
                     f"{r['victim_ttft_p90_ms']:.0f} | {r['victim_ttft_p99_ms']:.0f} | "
                     f"{r['victim_goodput']:.3f} | {sum(r['victim_refused'].values())} | "
                     f"{r['flooder_tokens_per_s']:.0f} | {r['utilisation']:.3f} | "
                     f"{_ms(r['victim_gateway_wait_ms'])} / {_ms(r['victim_engine_queue_ms'])} / "
                     f"{_ms(r['victim_prefill_ms'])} |")
    iso = [r for r in runs if r["mode"].startswith("isolation:")]
    if iso:
        lines += ["", "Isolation: B at half its fair share; A at its share, then 10x it "
                  "(B TTFT ms, p90 / p99)", "",
                  "| seed | mode | capacity req/s | A at share | A at 10x share | ratio p90 / "
                  "p99 | B goodput at 10x | utilisation at share / 10x | a new id per request: "
                  "B p90 / p99 change |", "|" + "---|" * 9]
        for r in iso:
            lines.append(
                f"| {r['seed']} | {r['mode'].split(':')[1]} | {r['capacity_rps']:.2f} | "
                f"{r['victim_at_fair_share_ttft_p90_ms']:.0f} / "
                f"{r['victim_at_fair_share_ttft_p99_ms']:.0f} | {r['victim_ttft_p90_ms']:.0f} / "
                f"{r['victim_ttft_p99_ms']:.0f} | {r['p90_ratio']:.2f} / {r['p99_ratio']:.2f} | "
                f"{r['victim_goodput']:.3f} | {r['utilisation_at_fair_share']:.3f} / "
                f"{r['utilisation']:.3f} | {_change(r)} |")
    for r in runs:
        if r["mode"] == "fair:two-flooders":
            lines.append(f"\nseed {r['seed']}, two flooders {r['flows']}: largest weighted "
                         f"service gap while both backlogged {r['service_gap']:.0f} tokens, "
                         f"VTC bound {r['vtc_bound']:.0f}")
        if r["mode"] == "fair:reserved-returns":
            lines.append(f"\nseed {r['seed']}, reserved tenant R returning half-way into the "
                         f"flood: its first request waited {r['first_gateway_wait_ms']:.1f} ms "
                         f"in the gateway (decision interval {r['decision_interval_ms']:.0f} "
                         f"ms); R's TTFT p90 {r['victim_ttft_p90_ms']:.0f} ms (alone "
                         f"{r['alone_ttft_p90_ms']:.0f}), goodput {r['victim_goodput']:.3f}")
    return "\n".join(lines) + "\n"


def _change(r: dict[str, Any]) -> str:
    if "rotating_ids_change_p90" not in r:
        return "-"
    return (f"{100 * r['rotating_ids_change_p90']:+.1f} % / "
            f"{100 * r['rotating_ids_change_p99']:+.1f} %")


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f}"


if __name__ == "__main__":
    main()
