"""bench-path's attribution of sampled stacks to stages, and its gross-regression check (the
CI step ``make lean`` fails on it)."""

from __future__ import annotations

from typing import Any

from benchmarks.path_report import check
from benchmarks.path_stages import STAGES, shares, stage_of

ROOT = "run (asyncio/runners.py:118);_run (asyncio/events.py:80)"


def stack(*frames: str) -> list[str]:
    return [*ROOT.split(";"), *frames]


def test_a_sample_is_put_in_the_stage_of_its_stack() -> None:
    redis = "execute (gateway/quota/limiter/redis_client.py:243)"
    # the same Redis call: admission's, or settlement's when settle is above it
    assert stage_of(stack("_reserve (gateway/request/pipeline.py:200)", redis)) == "admit"
    assert stage_of(stack("finish (gateway/request/settle.py:50)",
                          "settle (gateway/quota/ledger.py:300)", redis)) == "settle"
    # metrics and logs are theirs wherever they are called from
    assert stage_of(stack("finish (gateway/request/settle.py:50)",
                          "inc (prometheus_client/metrics.py:300)")) == "metrics"
    assert stage_of(stack("relay_stream (gateway/request/relay.py:200)",
                          "info (/usr/lib/python3.11/logging/__init__.py:1480)")) == "log"
    # parsing the body is not validating it
    assert stage_of(stack("begin (gateway/request/pipeline.py:120)",
                          "load_json (protocol/validate.py:40)")) == "accept and parse"
    assert stage_of(stack("begin (gateway/request/pipeline.py:120)",
                          "validate (protocol/validate.py:90)")) == "validate"
    assert stage_of(stack("hash (gateway/routing/prefix.py:48)")) == "route"
    assert stage_of(ROOT.split(";")) == "event loop"
    assert stage_of(["main (elsewhere.py:1)"]) == "other"


def test_shares_of_a_raw_profile() -> None:
    raw = (f"{ROOT};hash (gateway/routing/prefix.py:48) 3\n"
           f"{ROOT};finish (gateway/request/settle.py:50) 1\n")
    got, n = shares(raw)
    assert n == 4 and got["route"] == 0.75 and got["settle"] == 0.25
    assert set(got) == set(STAGES)


def test_the_log_writer_is_logging_and_its_waits_are_not_samples() -> None:
    thread = "_bootstrap (/usr/lib/python3.11/threading.py:995);run (threading.py:975)"
    writer = f"{thread};_run (protocol/log_writer.py:70)"
    raw = (f"{ROOT};hash (gateway/routing/prefix.py:48) 3\n"
           f"{writer};flush (protocol/log_writer.py:80) 1\n"
           f"{writer};wait (/usr/lib/python3.11/threading.py:622);"
           f"Condition.wait (/usr/lib/python3.11/threading.py:324) 6\n")
    got, n = shares(raw)
    assert n == 4 and got["route"] == 0.75 and got["log"] == 0.25


def run_with(stages_us: dict[str, float], direct_us: float = 100.0) -> dict[str, Any]:
    full = {s: stages_us.get(s, 0.0) for s in STAGES}
    return {"rounds": [{"tiny": {"new": {"cpu_us": sum(full.values()), "direct_us": direct_us,
                                          "stages_us": full, "requests": 1, "samples": 1}}}]}


def test_only_a_gross_regression_fails_the_check() -> None:
    budget = {"tiny": {"admit": 2.0, "route": 0.1, "send": 3.0, "trace": 0.0, "total": 10.0}}
    base = {"admit": 200.0, "route": 10.0, "send": 300.0}
    assert check(run_with(base), budget) == []
    # noise: a stage at 1.9x its budget, or a tiny stage (trace) from nothing
    assert check(run_with({**base, "admit": 380.0, "trace": 20.0}), budget) == []
    # the machine twice as slow: every stage and the direct path alike
    assert check(run_with({k: 2 * v for k, v in base.items()}, direct_us=200.0), budget) == []
    over = check(run_with({**base, "route": 400.0}), budget)
    assert len(over) == 1 and over[0].startswith("tiny: route")
    assert check(run_with({**base, "admit": 500.0}), budget)


def test_without_stages_only_the_total_is_checked() -> None:
    """Where py-spy cannot attach (no ptrace), each run has its total and no stages: the
    check still reads the total."""
    fine = run_with({"admit": 200.0, "send": 300.0})
    for r in fine["rounds"]:
        r["tiny"]["new"]["stages_us"] = {}
    budget = {"tiny": {"admit": 0.1, "total": 5.0}}
    assert check(fine, budget) == []
    slow = run_with({"admit": 200.0, "send": 1_500.0})
    for r in slow["rounds"]:
        r["tiny"]["new"]["stages_us"] = {}
    assert [x.split(" ")[1] for x in check(slow, budget)] == ["total"]
