"""Reports: ``report.json``, ``report.md``, per-request ``requests.csv`` and PNG plots.

One target gives one report; compare mode gives one directory per target plus a side-by-side
``report.md``, a ``report.json`` keyed by label, and overlaid plots.
"""

from __future__ import annotations

import csv
import json
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from loadtests.client import RequestResult
from loadtests.metrics import SLO, summarize, tpot
from loadtests.runner import RunOutput

STAT_KEYS = ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")


def build(run: RunOutput, slo: SLO, config: Mapping[str, Any]) -> dict[str, Any]:
    report = summarize(run.results, run.duration_s, slo)
    report["by_endpoint"] = dict(Counter(r.endpoint for r in run.results if r.endpoint))
    report["client_loop_lag_ms"] = run.loop_lag_ms
    report["slo"] = {"ttft_ms": slo.ttft_ms, "tpot_ms": slo.tpot_ms, "e2e_ms": slo.e2e_ms}
    report["config"] = dict(config)
    return report


def _fmt(v: Any) -> str:
    if v is None:
        return "—"
    if isinstance(v, float):
        return f"{v:,.1f}" if abs(v) >= 10 else f"{v:,.3g}"
    return str(v)


def markdown(reports: Mapping[str, Mapping[str, Any]]) -> str:
    labels = list(reports)
    head = "| metric | " + " | ".join(labels) + " |\n| --- |" + " ---: |" * len(labels)
    rows = [head]
    for key in ("requests", "completed", "failed", "duration_s", "request_throughput",
                "output_throughput", "goodput_rps", "goodput_fraction"):
        rows.append(f"| {key} | " + " | ".join(_fmt(reports[x].get(key)) for x in labels) + " |")
    for key in STAT_KEYS:
        for stat in ("mean", "p50", "p90", "p99"):
            vals = " | ".join(_fmt(reports[x][key].get(stat)) for x in labels)
            rows.append(f"| {key} {stat} | {vals} |")
    errors = " | ".join(_fmt(dict(reports[x]["errors"]) or "none") for x in labels)
    rows.append(f"| errors | {errors} |")
    endpoints = " | ".join(
        ", ".join(f"{k}: {v}" for k, v in sorted(reports[x]["by_endpoint"].items())) or "—"
        for x in labels)
    rows.append(f"| requests per endpoint | {endpoints} |")
    lag = " | ".join(_fmt(reports[x]["client_loop_lag_ms"].get("p99")) for x in labels)
    rows.append(f"| client loop lag p99 (ms) | {lag} |")
    first = reports[labels[0]]
    slo = ", ".join(f"{k} ≤ {v}" for k, v in first["slo"].items() if v is not None) or "none"
    cfg = first["config"]
    summary = ", ".join(f"{k}={v}" for k, v in cfg.items() if k != "targets")
    return (f"# Load test report\n\nWorkload: {summary}\n\nSLOs: {slo}\n\n"
            + "\n".join(rows) + "\n")


def _cdf(ax: Any, values: Sequence[float], label: str) -> None:
    if not values:
        return
    x = np.sort(np.asarray(values) * 1e3)
    ax.plot(x, np.arange(1, len(x) + 1) / len(x), label=label)


def plots(runs: Mapping[str, RunOutput], out: Path) -> list[str]:
    """Write the PNG plots (overlaid when several runs); return their file names."""
    written = []
    for name, title, pick in (
            ("ttft_cdf.png", "TTFT CDF", lambda r: [x.ttft for x in r.results
                                                    if x.ok and x.ttft is not None]),
            ("tpot_cdf.png", "TPOT CDF", lambda r: [t for x in r.results if x.ok
                                                    and (t := tpot(x)) is not None])):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for label, run in runs.items():
            _cdf(ax, pick(run), label)
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of requests")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / name, dpi=100)
        plt.close(fig)
        written.append(name)

    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    for label, run in runs.items():
        ok = [r for r in run.results if r.ok and r.ttft is not None]
        t = [r.sent_at - run.started_at for r in ok]
        ax1.scatter(t, [r.ttft * 1e3 for r in ok if r.ttft is not None], s=4, label=label)
        ax2.plot(*_throughput(run), label=label)
    ax1.set_ylabel("TTFT (ms)")
    ax1.set_yscale("log")
    ax1.set_title("Latency and output throughput over time")
    ax2.set_ylabel("output tokens/s")
    ax2.set_xlabel("seconds since start")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(out / "over_time.png", dpi=100)
    plt.close(fig)
    written.append("over_time.png")

    counts = {label: Counter(r.endpoint for r in run.results if r.endpoint)
              for label, run in runs.items()}
    if any(counts.values()):
        fig, ax = plt.subplots(figsize=(8, 4.5))
        names = sorted({e for c in counts.values() for e in c})
        width = 0.8 / len(counts)
        for i, (label, c) in enumerate(counts.items()):
            ax.bar(np.arange(len(names)) + i * width, [c.get(n, 0) for n in names], width,
                   label=label)
        ax.set_xticks(np.arange(len(names)) + 0.4 - width / 2, names, rotation=20,
                      fontsize=7)
        ax.set_ylabel("requests")
        ax.set_title("Requests per endpoint (x-tokengate-endpoint)")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "endpoints.png", dpi=100)
        plt.close(fig)
        written.append("endpoints.png")
    return written


def _throughput(run: RunOutput, bin_s: float = 1.0) -> tuple[list[float], list[float]]:
    """Output tokens per second, by completion time, in ``bin_s`` bins."""
    end = run.duration_s
    nbins = max(1, int(np.ceil(end / bin_s)))
    tokens = np.zeros(nbins)
    for r in run.results:
        if not r.ok:
            continue
        for t in r.chunk_times:  # each content chunk is (about) one token
            i = min(nbins - 1, max(0, int((t - run.started_at) / bin_s)))
            tokens[i] += 1
    xs = [(i + 0.5) * bin_s for i in range(nbins)]
    return xs, list(tokens / bin_s)


def requests_csv(results: Sequence[RequestResult], started_at: float, path: Path) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["sent_s", "ok", "error", "ttft_ms", "tpot_ms", "e2e_ms", "prompt_tokens",
                    "output_tokens", "cached_tokens", "endpoint"])
        for r in results:
            t = tpot(r)
            w.writerow([f"{r.sent_at - started_at:.4f}", int(r.ok), r.error or "",
                        f"{r.ttft * 1e3:.3f}" if r.ttft is not None else "",
                        f"{t * 1e3:.3f}" if t is not None else "",
                        f"{r.latency * 1e3:.3f}" if r.latency is not None else "",
                        r.prompt_tokens, r.output_tokens, r.cached_tokens, r.endpoint or ""])


def write(out: Path, runs: Mapping[str, RunOutput], reports: Mapping[str, dict[str, Any]]
          ) -> None:
    """Write everything under ``out`` (a subdirectory per target in compare mode)."""
    out.mkdir(parents=True, exist_ok=True)
    if len(runs) == 1:
        (label, run), = runs.items()
        report = reports[label]
        report["plots"] = plots(runs, out)
        (out / "report.json").write_text(json.dumps(report, indent=2))
        (out / "report.md").write_text(markdown({label: report}))
        requests_csv(run.results, run.started_at, out / "requests.csv")
        return
    for label, run in runs.items():
        sub = out / label
        sub.mkdir(exist_ok=True)
        reports[label]["plots"] = plots({label: run}, sub)
        (sub / "report.json").write_text(json.dumps(reports[label], indent=2))
        requests_csv(run.results, run.started_at, sub / "requests.csv")
    overlaid = plots(runs, out)
    (out / "report.json").write_text(json.dumps({"targets": reports, "plots": overlaid},
                                                indent=2))
    (out / "report.md").write_text(markdown(reports))
