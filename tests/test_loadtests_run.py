"""The harness end to end against a reference backend on loopback."""

from __future__ import annotations

import asyncio
import csv
import json
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import RunningBackend

from backend.textgen import LengthDistribution
from loadtests import workloads
from loadtests.metrics import SLO
from loadtests.run import LoadtestConfig, run_all
from loadtests.runner import Target
from loadtests.traces import TRACES
from tokengate.cli import main

Factory = Callable[..., RunningBackend]
REQUIRED = {"requests", "completed", "failed", "duration_s", "request_throughput",
            "output_throughput", "ttft_ms", "tpot_ms", "itl_ms", "e2e_ms", "goodput_rps",
            "goodput_fraction", "by_endpoint", "errors", "config"}


def test_synthetic_run_writes_a_complete_report(backend_factory: Factory, tmp_path: Path) -> None:
    b = backend_factory(time_scale=0.05)
    out = tmp_path / "run"
    code = main(["loadtest", "--base-url", f"{b.url}/v1", "--workload", "synthetic",
                 "--rate", "40", "--requests", "30", "--input-len", "uniform:50:400",
                 "--output-len", "fixed:12", "--slo-ttft-ms", "5000", "--seed", "2",
                 "--no-progress", "--out", str(out)])
    assert code == 0
    rep = json.loads((out / "report.json").read_text())
    assert set(rep) >= REQUIRED
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        assert set(rep[key]) >= {"mean", "p50", "p90", "p99"} and rep[key]["p50"] > 0
    assert rep["requests"] == rep["completed"] == 30 and rep["failed"] == 0
    assert rep["output_throughput"] * rep["duration_s"] == pytest.approx(30 * 12)
    assert rep["goodput_fraction"] == 1.0 and rep["config"]["seed"] == 2
    for png in ("ttft_cdf.png", "tpot_cdf.png", "over_time.png"):
        assert (out / png).stat().st_size > 1000
    lines = (out / "requests.csv").read_text().splitlines()
    assert len(lines) == 31 and "TTFT" not in (out / "report.md").read_text().split("|")[0]


def test_compare_mode_runs_the_same_workload_on_each_target(backend_factory: Factory,
                                                             tmp_path: Path) -> None:
    fast = backend_factory(time_scale=0.02)
    slow = backend_factory(time_scale=0.2)
    cfg = LoadtestConfig(
        targets=[Target("fast", f"{fast.url}/v1"), Target("slow", f"{slow.url}/v1")],
        out=tmp_path, workload="trace",
        trace=str(TRACES / "mooncake_synthetic.jsonl"),
        requests=12, time_scale=0.001, max_input=4000, slo=SLO(ttft_ms=10_000), progress=False)
    reports = asyncio.run(run_all(cfg))
    assert set(reports) == {"fast", "slow"}
    assert all(r["completed"] == 12 for r in reports.values())
    # Same prompts and lengths on both sides; the slower GPU model shows in TPOT.
    assert reports["fast"]["total_input_tokens"] == reports["slow"]["total_input_tokens"]
    assert reports["fast"]["tpot_ms"]["p50"] < reports["slow"]["tpot_ms"]["p50"]
    combined = json.loads((tmp_path / "report.json").read_text())
    assert set(combined["targets"]) == {"fast", "slow"}
    assert (tmp_path / "fast" / "report.json").exists() and (tmp_path / "ttft_cdf.png").exists()
    md = (tmp_path / "report.md").read_text()
    assert "| metric | fast | slow |" in md


def test_sessions_reuse_their_prefix(backend_factory: Factory, tmp_path: Path) -> None:
    b = backend_factory(time_scale=0.02)
    cfg = LoadtestConfig(
        targets=[Target("b", f"{b.url}/v1")], out=tmp_path, workload="sessions",
        endpoint="chat", rate=5.0, output_len="fixed:8", progress=False,
        sessions=workloads.SessionSpec(sessions=2, turns=4, agent_types=1, system_tokens=300,
                                       task_tokens=50, tool_tokens=100,
                                       output=LengthDistribution("fixed", 8), think_time_s=0.01))
    rep = asyncio.run(run_all(cfg))["b"]
    assert rep["completed"] == 8 and rep["failed"] == 0
    with (tmp_path / "requests.csv").open() as f:
        rows = list(csv.DictReader(f))
    prompts = sorted(int(r["prompt_tokens"]) for r in rows)
    cached = [int(r["cached_tokens"]) for r in rows]
    assert prompts[-1] > prompts[0] + 300  # contexts grow turn by turn
    assert sum(1 for c in cached if c >= 300) >= 6  # later turns hit the shared prefix


def test_failures_are_classified(backend_factory: Factory, tmp_path: Path) -> None:
    import httpx

    b = backend_factory(time_scale=0.02)
    httpx.post(f"{b.url}/admin/faults", json={"error_rate": 0.5, "error_status": 503,
                                              "drop_rate": 0.4, "drop_after_tokens": 2})
    cfg = LoadtestConfig(targets=[Target("b", f"{b.url}/v1")], out=tmp_path, rate=50,
                         requests=40, input_len="fixed:20", output_len="fixed:10",
                         progress=False)
    rep = asyncio.run(run_all(cfg))["b"]
    errors = rep["errors"]
    assert set(errors) == {"http_503:injected_fault", "broken_stream"}
    assert rep["failed"] == sum(errors.values()) and rep["completed"] + rep["failed"] == 40
    assert rep["completed"] > 0 and rep["ttft_ms"]["p50"] is not None


def test_bad_arguments_are_reported(tmp_path: Path, capsys: object) -> None:
    assert main(["loadtest", "--out", str(tmp_path), "--workload", "synthetic",
                 "--requests", "1"]) == 2
    assert main(["loadtest", "--base-url", "http://127.0.0.1:9/v1", "--out", str(tmp_path),
                 "--target", "bad"]) == 2
    assert main(["loadtest", "--base-url", "http://127.0.0.1:9/v1", "--out", str(tmp_path),
                 "--workload", "synthetic"]) == 2
    # Only loopback targets unless asked: nothing is sent anywhere else by accident.
    assert main(["loadtest", "--base-url", "http://10.1.2.3:8000/v1", "--out", str(tmp_path),
                 "--workload", "synthetic", "--requests", "1"]) == 2
