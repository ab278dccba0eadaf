"""The strategy matrix's report: a table per cell and one summary plot (``simulator.matrix``)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

DEFAULT = "predicted"


def _cells(rows: list[dict[str, Any]]) -> dict[tuple[Any, ...], dict[str, dict[str, Any]]]:
    cells: dict[tuple[Any, ...], dict[str, dict[str, Any]]] = defaultdict(dict)
    for r in rows:
        key: tuple[Any, ...] = (r["workload"], r["load"], r["burstiness"], r["pool"])
        if "seed" in r:  # one cell per seed (``--seeds``)
            key = (*key, r["seed"])
        cells[key][r["strategy"]] = r
    return cells


def verdicts(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per cell: is the default within 3 % of the best (hindsight excluded) on TTFT p50, p99
    and goodput, and the share of the round-robin → hindsight TTFT p50 gap it captures."""
    out = []
    for key, by in _cells(rows).items():
        peers = {s: r for s, r in by.items() if s != "hindsight"}
        d = peers.get(DEFAULT)
        if d is None:
            continue
        best50 = min(r["ttft_p50"] for r in peers.values())
        best99 = min(r["ttft_p99"] for r in peers.values())
        bestg = max(r["goodput"] for r in peers.values())
        v: dict[str, Any] = {"cell": key, "p50_ok": d["ttft_p50"] <= 1.03 * best50,
                             "p99_ok": d["ttft_p99"] <= 1.03 * best99,
                             "goodput_ok": d["goodput"] >= bestg - 0.03}
        rr, h = by.get("round_robin"), by.get("hindsight")
        if rr is not None and h is not None and rr["ttft_p50"] > h["ttft_p50"]:
            v["gap_captured"] = (rr["ttft_p50"] - d["ttft_p50"]) / (rr["ttft_p50"]
                                                                     - h["ttft_p50"])
        out.append(v)
    return out


def write(rows: list[dict[str, Any]], out: Path) -> None:
    strategies = list(dict.fromkeys(r["strategy"] for r in rows))
    head = "| workload | load | burst | pool | " + " | ".join(strategies) + " |\n" + \
        "| --- | ---: | ---: | --- |" + " ---: |" * len(strategies)
    lines = [head]
    for (w, load, burst, pool, *seed), by in _cells(rows).items():
        peers = [r for s, r in by.items() if s != "hindsight"]
        best = min(r["ttft_p50"] for r in peers) if peers else None
        cells = []
        for s in strategies:
            r = by.get(s)
            if r is None:
                cells.append("—")
                continue
            mark = "**" if best is not None and s != "hindsight" and r["ttft_p50"] == best \
                else ""
            cells.append(f"{mark}{r['ttft_p50']:,.0f}{mark} / {r['ttft_p99']:,.0f} / "
                         f"{r['goodput']:.0%}")
        label = f"{pool} (seed {seed[0]})" if seed else pool
        lines.append(f"| {w} | {load:.0%} | {burst:g} | {label} | " + " | ".join(cells) + " |")
    vs = verdicts(rows)
    ok = sum(v["p50_ok"] and v["p99_ok"] and v["goodput_ok"] for v in vs)
    gaps = [v["gap_captured"] for v in vs if "gap_captured" in v and v["cell"][1] == 0.65]
    summary = (f"`{DEFAULT}` within 3 % of the best strategy on TTFT p50, p99 and goodput in "
               f"{ok} of {len(vs)} cells; share of the round-robin → hindsight TTFT p50 gap "
               f"captured at 65 % load: "
               + (", ".join(f"{g:.0%}" for g in gaps) if gaps else "—"))
    (out / "matrix.md").write_text(
        "# Strategy matrix (simulated)\n\nEach cell: TTFT p50 / p99 (ms) / goodput; the best "
        "p50 in bold (hindsight excluded).\n\n" + "\n".join(lines) + f"\n\n{summary}\n")
    _plot(rows, strategies, out / "matrix.png")


def _plot(rows: list[dict[str, Any]], strategies: list[str], path: Path) -> None:
    """TTFT p50 relative to round robin's, geometric mean over each workload's cells, one
    panel per pool shape (the hindsight oracle routes aggregated pools only)."""
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5), sharey=True)
    for ax, pool in zip(axes, ("agg", "pd"), strict=True):
        by_w: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
        for key, by in _cells(rows).items():
            rr = by.get("round_robin")
            if key[3] != pool or rr is None or not rr["ttft_p50"]:
                continue
            for s, r in by.items():
                by_w[key[0]][s].append(r["ttft_p50"] / rr["ttft_p50"])
        names = list(by_w)
        width = 0.8 / max(len(strategies), 1)
        for i, s in enumerate(strategies):
            vals = [float(np.exp(np.mean(np.log(by_w[w][s])))) if by_w[w][s] else np.nan
                    for w in names]
            ax.bar(np.arange(len(names)) + i * width, vals, width, label=s)
        ax.axhline(1.0, color="black", lw=0.8)
        ax.set_xticks(np.arange(len(names)) + 0.4 - width / 2, names)
        ax.set_title("4 aggregated" if pool == "agg" else "2 prefill + 2 decode")
    axes[0].set_ylabel("TTFT p50 / round robin's (geo. mean over cells)")
    axes[1].legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
