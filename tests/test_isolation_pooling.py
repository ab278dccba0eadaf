"""The isolation benchmark's ratios pooled over runs, and how far one run's ratio moves with
which requests it happened to send."""

from __future__ import annotations

from typing import Any

import numpy as np

from benchmarks.engine_queues import victim_view
from benchmarks.sim_fairness_confirm_report import pooled, ratio_interval


def run(mode: str, share: list[float], flood: list[float]) -> dict[str, Any]:
    return {"mode": mode, "at_share": {"victim_ttft_ms": share},
            "at_10x": {"victim_ttft_ms": flood}}


def test_runs_are_pooled_per_mode_request_by_request() -> None:
    rng = np.random.default_rng(1)
    a1, a2 = list(rng.uniform(10, 100, 150)), list(rng.uniform(10, 100, 150))
    f1, f2 = list(rng.uniform(10, 150, 150)), list(rng.uniform(10, 200, 150))
    out = pooled([run("fair", a1, f1), run("fair", a2, f2), run("fcfs", a1, f2)])
    fair = out["fair"]
    assert fair["runs"] == 2 and fair["requests"] == [300, 300]
    want = np.percentile(f1 + f2, 90) / np.percentile(a1 + a2, 90)
    assert abs(fair["p90_ratio"] - want) < 1e-9  # the percentile of all, not a mean of ratios
    lo, hi = fair["p90_ratio_5_95"]
    assert lo < want < hi
    assert out["fcfs"]["runs"] == 1
    assert pooled([{"mode": "fair", "at_share": {}, "at_10x": {}}]) == {}  # older reports


def test_the_interval_narrows_with_more_requests() -> None:
    rng = np.random.default_rng(2)
    few = ratio_interval(list(rng.exponential(50, 150)), list(rng.exponential(75, 150)), 90)
    many = ratio_interval(list(rng.exponential(50, 3000)), list(rng.exponential(75, 3000)), 90)
    assert few[0] < many[0] < 1.5 < many[1] < few[1]
    assert many[1] - many[0] < (few[1] - few[0]) / 2


def test_the_victims_own_requests_ahead_of_it_are_told_apart() -> None:
    eng = {"a1": {"port": 1, "arrival": 0, "scheduled": 5, "finished": 9},
           "b1": {"port": 1, "arrival": 1, "scheduled": 6, "finished": 9},
           "b2": {"port": 1, "arrival": 2, "scheduled": 7, "finished": 9},
           "a2": {"port": 2, "arrival": 0, "scheduled": 1, "finished": 9}}
    v = victim_view(["b1", "b2"], eng)
    assert v["ahead"][2] == 1.5  # b1 finds a1 waiting; b2 finds a1 and b1
    assert v["ahead_own"][2] == 0.5  # of those, b1 is the victim's own
    assert v["ahead_elsewhere"][2] == 0.0 and v["shorter_elsewhere"] == 1.0
