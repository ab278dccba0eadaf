"""The table ``benchmarks.sim_fairness_confirm`` prints: each run's figures in real time beside
the simulation's of the same requests."""

from __future__ import annotations

from typing import Any


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
