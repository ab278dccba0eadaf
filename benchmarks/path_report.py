"""``benchmarks.path``'s figures: the per-stage table, each stage as a multiple of the direct
path, and the gross-regression check ``make lean`` fails on."""

from __future__ import annotations

import math
import statistics
from typing import Any

from benchmarks.path_stages import STAGES


def table(result: dict[str, Any]) -> str:
    """Median over rounds of each stage's µs CPU per request, one column per payload/tree."""
    cols: list[tuple[str, str]] = []
    for row in result["rounds"]:
        for name, by_tree in row.items():
            for tag in by_tree:
                if (name, tag) not in cols:
                    cols.append((name, tag))

    def med(name: str, tag: str, key: str, stage: str | None = None) -> float:
        xs = [r[name][tag]["stages_us"].get(stage, math.nan) if stage else r[name][tag][key]
              for r in result["rounds"] if name in r and tag in r[name]]
        return float(statistics.median(xs)) if xs else math.nan

    head = "| stage | " + " | ".join(f"{n} ({t})" for n, t in cols) + " |"
    lines = [head, "|---" * (len(cols) + 1) + "|"]
    for s in STAGES:
        lines.append(f"| {s} | " + " | ".join(f"{med(n, t, '', s):,.0f}" for n, t in cols)
                     + " |")
    lines.append("| **total** | " + " | ".join(f"**{med(n, t, 'cpu_us'):,.0f}**"
                                               for n, t in cols) + " |")
    lines.append("| direct path (echo upstream) | " + " | ".join(
        f"{med(n, t, 'direct_us'):,.0f}" for n, t in cols) + " |")
    if any(" epp" in t for _, t in cols):
        lines.append("| Envoy beside the EPP | " + " | ".join(
            f"{med(n, t, 'envoy_us'):,.0f}" if " epp" in t else "" for n, t in cols) + " |")
    return "\n".join(lines)


def ratios(result: dict[str, Any], tag: str = "new") -> dict[str, dict[str, float]]:
    """Per payload, each stage's median CPU per request as a multiple of the direct path's."""
    out: dict[str, dict[str, float]] = {}
    for name in result["rounds"][0]:
        runs = [r[name][tag] for r in result["rounds"] if tag in r.get(name, {})]
        per: dict[str, float] = {}
        sampled = all(x["stages_us"] for x in runs)
        for s in (*STAGES, "total") if sampled else ("total",):
            per[s] = float(statistics.median(
                (x["cpu_us"] if s == "total" else x["stages_us"][s]) / max(x["direct_us"], 1e-9)
                for x in runs))
        out[name] = per
    return out


def check(result: dict[str, Any], budget: dict[str, dict[str, float]]) -> list[str]:
    """Stages over twice their budget by more than 5 % of the request's CPU (gross only)."""
    over = []
    for name, per in ratios(result).items():
        if name not in budget:
            continue
        total = per["total"]
        for s, got in per.items():
            allowed = budget[name].get(s, 0.0)
            if got > 2 * allowed and got - 2 * allowed > 0.05 * max(total, budget[name]["total"]):
                over.append(f"{name}: {s} {got:.2f}× direct against a budget of {allowed:.2f}×")
    return over
