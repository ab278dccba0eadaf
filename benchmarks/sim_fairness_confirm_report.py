"""What ``benchmarks.sim_fairness_confirm`` prints: each run's figures in real time beside the
simulation's of the same requests, and the isolation ratios pooled over runs
(``python -m benchmarks.sim_fairness_confirm_report DIR...`` pools several reports)."""

from __future__ import annotations

from typing import Any

import numpy as np


def markdown(runs: list[dict[str, Any]]) -> str:
    cols = [("victim_ttft_p50_ms", "B TTFT p50 ms", "{:.0f}"),
            ("victim_ttft_p90_ms", "B TTFT p90 ms", "{:.0f}"),
            ("victim_ttft_p99_ms", "B TTFT p99 ms", "{:.0f}"),
            ("victim_goodput", "B goodput", "{:.3f}"),
            ("flooder_tokens_per_s", "A tokens/s", "{:.0f}"),
            ("utilisation", "utilisation", "{:.3f}")]
    lines = ["| seed | mode | " + " | ".join(f"{h} real / sim" for _, h, _ in cols) +
             " | errors | backend lag max ms |", "|" + "---|" * (len(cols) + 4)]
    for r in runs:
        cells = [f"{f.format(r['real'][k])} / {f.format(r['simulated'][k])}"
                 for k, _, f in cols]
        lines.append(f"| {r['seed']} | {r['mode']} | " + " | ".join(cells) +
                     f" | {r['real']['errors']} | {r['real']['lag_max_ms']:.0f} |")
    return "\n".join(lines) + "\n"


def ratio_interval(share: list[float], flood: list[float], q: float, draws: int = 2000,
                   seed: int = 0) -> tuple[float, float]:
    """The 5th and 95th percentiles of the victim's TTFT ``q``-th percentile under the flood
    over the same with the flooder at its share, each run's requests resampled with
    replacement (a bootstrap): how far the ratio moves with which requests happened to be
    sent, before any difference between runs."""
    rng = np.random.default_rng(seed)
    a, b = np.asarray(share, dtype=float), np.asarray(flood, dtype=float)
    r = [np.percentile(rng.choice(b, b.size), q) / np.percentile(rng.choice(a, a.size), q)
         for _ in range(draws)]
    lo, hi = np.percentile(r, [5, 95])
    return float(lo), float(hi)


def pooled(runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per mode, the isolation ratios over every run's victim requests together (each run's
    answered TTFTs, ``victim_ttft_ms``), with their bootstrap intervals: several runs (seeds,
    or the same requests again) measure the ratio more closely than any one of them."""
    out: dict[str, dict[str, Any]] = {}
    for mode in dict.fromkeys(r["mode"] for r in runs):
        mine = [r for r in runs if r["mode"] == mode and "victim_ttft_ms" in r["at_share"]]
        if not mine:
            continue
        share = [x for r in mine for x in r["at_share"]["victim_ttft_ms"]]
        flood = [x for r in mine for x in r["at_10x"]["victim_ttft_ms"]]
        row: dict[str, Any] = {"runs": len(mine), "requests": [len(share), len(flood)]}
        for q in (90, 99):
            row[f"p{q}_ms"] = [float(np.percentile(share, q)), float(np.percentile(flood, q))]
            row[f"p{q}_ratio"] = row[f"p{q}_ms"][1] / row[f"p{q}_ms"][0]
            row[f"p{q}_ratio_5_95"] = list(ratio_interval(share, flood, q))
        out[mode] = row
    return out


if __name__ == "__main__":  # pool the isolation runs of several reports: DIR...
    import json
    import sys
    from pathlib import Path
    every = [r for d in sys.argv[1:]
             for r in json.loads((Path(d) / "report.json").read_text())["runs"]]
    print(json.dumps(pooled(every), indent=1))
