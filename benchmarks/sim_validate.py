"""The simulator against the real-time stack, on the same schedules.

    python -m benchmarks.sim_validate [--workloads synthetic,azure-code,sessions] [--strategy S]
        [--out DIR]

For each workload a real ``tokengate up`` stack (4 reference backends, the gateway, no quotas)
is started, the load harness replays the workload through it in real time, the stack is
stopped, and the same workload and fleet flags are simulated. The figures compared are TTFT
and TPOT p50/p90; ``report.md`` under ``--out`` has both runs side by side and the relative
error of each figure (simulated − real) / real.

The workloads are sized for this machine kind (2 cores shared by four backends, the gateway
and the client): a real stack can only be compared with its model while it keeps up with it,
so each keeps the engines' step rate moderate (a 32B model on H100s: steps of tens of ms).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from benchmarks import routing as bench_routing
from gateway.examples import DEMO_POLICY
from loadtests import workloads
from loadtests.metrics import SLO
from loadtests.run import LoadtestConfig, run_all
from loadtests.runner import Target
from loadtests.traces import TRACES
from protocol.loopback import DEMO_KEY
from simulator.run import SimConfig, simulate
from simulator.workload import WorkloadSpec
from stack.pool_shape import PoolShape

FIGURES = (("ttft_ms", "p50"), ("ttft_ms", "p90"), ("tpot_ms", "p50"), ("tpot_ms", "p90"))


@dataclass(frozen=True, slots=True)
class Case:
    name: str
    spec: WorkloadSpec
    endpoint: str = "completions"
    shape: PoolShape = field(default_factory=lambda: PoolShape(
        backends=4, model="qwen3-32b", hardware="h100-sxm", no_quota=True))
    slo: SLO = field(default_factory=SLO)


def cases(scale: float = 1.0) -> dict[str, Case]:
    """The validation workloads; ``scale`` multiplies how many requests each sends."""
    n = max(int(80 * scale), 10)
    return {
        "synthetic": Case("synthetic", WorkloadSpec(
            "synthetic", requests=n, rate=2.0, burstiness=1.0, input_len="uniform:256:3072",
            output_len="uniform:16:160", seed=1)),
        # 60 of the trace's rows span 39 s; its rows 60-80 alone span another 150 s
        "azure-code": Case("azure-code", WorkloadSpec(
            "trace", str(TRACES / "azure_llm_2023_code.csv"), requests=max(n * 3 // 4, 10),
            time_scale=1.0)),
        "sessions": Case("sessions", WorkloadSpec(
            "sessions", requests=n, rate=0.5, sessions=workloads.SessionSpec(
                sessions=max(n // 6, 2), turns=6, agent_types=2, system_tokens=1500,
                task_tokens=200, tool_tokens=600,
                output=workloads.parse_lengths("uniform:16:96", "output"),
                think_time_s=0.5), seed=2), endpoint="chat"),
    }


def loadtest(case: Case, base_url: str, out: Path) -> dict[str, Any]:
    w = case.spec
    cfg = LoadtestConfig(
        targets=[Target("real", base_url, DEMO_KEY, "demo-large")], out=out,
        workload=w.kind, trace=w.trace, endpoint="chat" if case.endpoint == "chat"
        else "completions", rate=w.rate, burstiness=w.burstiness, requests=w.requests,
        time_scale=w.time_scale, input_len=w.input_len, output_len=w.output_len,
        sessions=w.sessions or workloads.SessionSpec(), slo=case.slo, seed=w.seed,
        progress=False)
    return asyncio.run(run_all(cfg))["real"]


@contextlib.contextmanager
def fleet(shape: PoolShape, strategy: str, budget: int = 8192
          ) -> Iterator[tuple[str, list[str]]]:
    """A real ``tokengate up`` stack (the demo policy, every endpoint on a free port), warmed
    up; yields the gateway's OpenAI base URL and the backends' base URLs."""
    args = argparse.Namespace(model=shape.model, hardware=shape.hardware,
                              index=None, no_share=False, redis=None, time_scale=1.0)
    logs = Path(tempfile.mkdtemp(prefix="tokengate-validate-"))
    # the demo policy with every endpoint on a free port (its fallback's is fixed)
    raw = yaml.safe_load(DEMO_POLICY.read_text())
    for m in raw["models"].values():
        m["endpoints"] = [{"url": "http://127.0.0.1:0/v1"} for _ in m["endpoints"]]
    policy = logs / "policy.yaml"
    policy.write_text(yaml.safe_dump(raw, sort_keys=False))
    proc, port = bench_routing.start_stack(
        args, strategy, ["--policy", str(policy), "--backends", str(shape.backends)],
        logs, budget)
    try:
        asyncio.run(bench_routing.wait_stack(proc, port, logs, strategy))
        gw = f"http://127.0.0.1:{port}"
        eps = bench_routing.fetch(f"{gw}/admin/endpoints", admin=True)["demo-large"]
        backends = [e["url"].removesuffix("/v1") for e in eps["endpoints"]]
        yield gw + "/v1", backends
    finally:
        bench_routing.stop_stack(proc)


def warm(base: str, out: Path) -> None:
    """A fresh stack's first requests pay one-off costs (imports, first tokenizations, the
    first fits): a few unmeasured requests first, sharing no prefix with any run."""
    loadtest(Case("warm-up", WorkloadSpec("synthetic", requests=16, rate=8.0,
                                           input_len="uniform:64:2048", output_len="fixed:16",
                                           seed=999)), base, out)


def real_run(case: Case, strategy: str, out: Path) -> dict[str, Any]:
    with fleet(case.shape, strategy) as (base, _):
        warm(base, out.parent / "warm-up")
        return loadtest(case, base, out)


def sim_run(case: Case, strategy: str, out: Path | None) -> dict[str, Any]:
    cfg = SimConfig(case.spec, shape=replace(case.shape, strategy=strategy), slo=case.slo,
                    out=out)
    return simulate(cfg).report


def compare(real: dict[str, Any], sim: dict[str, Any]) -> dict[str, float]:
    out = {}
    for key, stat in FIGURES:
        r, s = real[key][stat], sim[key][stat]
        out[f"{key}.{stat}"] = (s - r) / r if r else float("nan")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", default="synthetic,azure-code,sessions")
    ap.add_argument("--strategy", default="predicted")
    ap.add_argument("--scale", type=float, default=1.0, help="multiply the request counts")
    ap.add_argument("--out", default="/tmp/tokengate-validate")
    a = ap.parse_args(argv)
    out = Path(a.out)
    rows, doc = [], {}
    for name in a.workloads.split(","):
        case = cases(a.scale)[name]
        real = real_run(case, a.strategy, out / name / "real")
        sim = sim_run(case, a.strategy, out / name / "simulated")
        err = compare(real, sim)
        doc[name] = {"real": {k: real[k] for k in ("ttft_ms", "tpot_ms", "completed")},
                     "simulated": {k: sim[k] for k in ("ttft_ms", "tpot_ms", "completed")},
                     "error": err, "speedup": sim["simulation"]["speedup"]}
        for (key, stat) in FIGURES:
            rows.append(f"| {name} | {key} {stat} | {real[key][stat]:.1f} | "
                        f"{sim[key][stat]:.1f} | {err[f'{key}.{stat}']:+.1%} |")
        print("\n".join(rows[-4:]), flush=True)
    table = ("| workload | figure | real | simulated | error |\n"
             "| --- | --- | ---: | ---: | ---: |\n" + "\n".join(rows))
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.md").write_text(f"# Simulator validation ({a.strategy})\n\n{table}\n")
    (out / "validation.json").write_text(json.dumps(doc, indent=2))
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
