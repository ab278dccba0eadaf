"""``bench_peers``'s report: ``report.json`` (every round), ``report.md`` (the median table,
then every round's figures) and ``peers.png`` (added latency and throughput per proxy)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def _f(x: float | None, fmt: str) -> str:
    return "—" if x is None else format(x, fmt)


def table(rep: dict[str, Any]) -> str:
    clients = sorted(int(k.split("_")[1]) for k in rep["rounds"][0] if k.startswith("load_"))
    head = ["proxy", "added p50 (ms)", "added p99", "stream TTFC added p50"]
    head += [f"req/s, {c} clients" for c in clients]
    head += [f"CPU s / 1K req ({c})" for c in clients]
    lines = ["| " + " | ".join(head) + " |", "| --- |" + " ---: |" * (len(head) - 1)]
    direct = [r[f"load_{c}"]["direct"]["rps"] for r in rep["rounds"] for c in clients]
    for name, row in rep["summary"].items():
        cells = [name, _f(row["plain_added_p50_ms"], "+.2f"), _f(row["plain_added_p99_ms"], "+.2f"),
                 _f(row["stream_added_p50_ms"], "+.2f")]
        cells += [_f(row.get(f"rps_{c}"), ",.0f") for c in clients]
        cells += [_f(row.get(f"cpu_s_per_1000_{c}"), ".2f") for c in clients]
        lines.append("| " + " | ".join(cells) + " |")
    by_c = ", ".join(f"{c} clients: " + " / ".join(
        f"{r[f'load_{c}']['direct']['rps']:,.0f}" for r in rep["rounds"]) for c in clients)
    lines.append("")
    lines.append(f"Direct to one upstream, req/s by round ({by_c}); medians over "
                 f"{len(rep['rounds'])} rounds above." if direct else "")
    return "\n".join(lines)


def rounds_table(rep: dict[str, Any]) -> str:
    clients = sorted(int(k.split("_")[1]) for k in rep["rounds"][0] if k.startswith("load_"))
    lines = ["| round | proxy | added p50 | added p99 | stream added p50 | "
             + " | ".join(f"req/s {c}" for c in clients) + " | "
             + " | ".join(f"CPU/1K {c}" for c in clients) + " |",
             "| ---: | --- |" + " ---: |" * (3 + 2 * len(clients))]
    for r in rep["rounds"]:
        for name in r["order"]:
            pl, st = r["plain"]["proxies"][name], r["stream"]["proxies"][name]
            cells = [str(r["round"]), name, f"{pl['added_p50_ms']:+.2f}",
                     f"{pl['added_p99_ms']:+.2f}", f"{st['added_p50_ms']:+.2f}"]
            cells += [f"{r[f'load_{c}'][name]['rps']:,.0f}" for c in clients]
            cells += [_f(r[f"load_{c}"][name]["cpu_s_per_1000"], ".2f") for c in clients]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def syscall_table(rep: dict[str, Any]) -> str:
    traced = rep.get("syscalls") or {}
    if not traced:
        return ""
    lines = ["", "", "System calls per request (`strace -c -f` during 3 s of wrk at 16 clients; "
             "tracing slows every proxy, the counts per request are what to read):", "",
             "| proxy | all | most frequent |", "| --- | ---: | --- |"]
    for name, t in traced.items():
        top = ", ".join(f"{k} {v:.2f}" for k, v in t["top"].items())
        lines.append(f"| {name} | {t['per_request']:.1f} | {top} |")
    return "\n".join(lines)


def write(rep: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(rep, indent=2))
    loads = [v for k, v in rep["rounds"][0].items() if k.startswith("load_")]
    tool = ", ".join(next(iter(v.values()))["tool"] for v in loads)
    (out / "report.md").write_text(
        f"# tokengate and its peers, side by side ({rep['when']})\n\n"
        f"Same two zero-delay echo upstreams behind every proxy; one client interleaved over "
        f"the targets ({rep['requests']} requests each, per round); load with {tool}, "
        f"{rep['seconds']:g} s per target; tokengate with "
        f"{rep.get('tokengate_workers', 1)} worker process(es), quota leases "
        f"{rep.get('quota_lease', 0.0):g} of a bucket.\n\n" + table(rep)
        + syscall_table(rep) + "\n\n## Every round\n\n" + rounds_table(rep) + "\n")
    names = list(rep["summary"])
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    axes[0].barh(names, [rep["summary"][n]["plain_added_p50_ms"] for n in names])
    axes[0].set_xlabel("added latency p50, 1 client (ms)")
    clients = sorted(int(k.split("_")[1]) for k in rep["rounds"][0] if k.startswith("load_"))
    h = 0.8 / max(len(clients), 1)
    for i, c in enumerate(clients):
        axes[1].barh([k + i * h for k in range(len(names))],
                     [rep["summary"][n][f"rps_{c}"] for n in names], height=h,
                     label=f"{c} clients")
    axes[1].set_yticks(range(len(names)), names)
    axes[1].set_xlabel("requests / s")
    axes[1].legend()
    fig.tight_layout()
    fig.savefig(out / "peers.png", dpi=110)
    plt.close(fig)
