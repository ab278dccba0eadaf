"""The simulator against the real-time stack on the same schedules (``simulator.validate``):
on three workloads (synthetic, the Azure code trace, agent sessions) a real ``tokengate up``
fleet of four reference backends and the simulator agree on TTFT and TPOT p50 and p90 within
10 %. Each case replays 80 requests (~40 s) in real time."""

from __future__ import annotations

from pathlib import Path

import pytest

from simulator import validate


@pytest.mark.parametrize("name", ["synthetic", "azure-code", "sessions"])
def test_the_simulator_agrees_with_the_real_stack(name: str, tmp_path: Path) -> None:
    case = validate.cases()[name]
    real = validate.real_run(case, "round_robin", tmp_path / "real")
    sim = validate.sim_run(case, "round_robin", None)
    assert real["completed"] == sim["completed"] == real["requests"]
    errors = validate.compare(real, sim)
    figures = {f"{k}.{s}": (real[k][s], sim[k][s]) for k, s in validate.FIGURES}
    assert all(abs(e) <= 0.10 for e in errors.values()), (errors, figures)
