"""The simulator against the real-time stack on the same schedules (``benchmarks.sim_validate``):
on three workloads (synthetic, the Azure code trace, agent sessions) a real ``tokengate up``
fleet of four reference backends and the simulator agree on TTFT and TPOT p50 and p90 within
10 % -- but for the p90s of the Azure code trace (15 %) and of the sessions (20 %). The real
tails move with this 2-core machine's speed while the simulation is deterministic: the Azure
code trace's real tail moves ~5 % run to run and the simulated TPOT p90 sits 8-10 % above it
(three runs, ``benchmarks/results/sim-2026-12-01``); the sessions' real TTFT p90 was 203.7 ms
in the final run there, 207.5-220.0 ms in four runs on a quiet machine (2026-12-01 21:30) and
226-246 ms in four runs inside CI runs of the whole suite, against the same simulated
201.1 ms. Gaps left to close (the simulator's fixed per-request overhead is one machine's,
fitted once). A real run is noisy: one that misses is re-taken once, and both are printed.
Each case replays 80 requests (the Azure trace 60) in real time."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import sim_validate as validate

P90_TOLERANCE = {"azure-code": 0.15, "sessions": 0.20}


@pytest.mark.parametrize("name", ["synthetic", "azure-code", "sessions"])
def test_the_simulator_agrees_with_the_real_stack(name: str, tmp_path: Path) -> None:
    case = validate.cases()[name]
    sim = validate.sim_run(case, "round_robin", None)

    def within(errors: dict[str, float]) -> bool:
        return all(abs(e) <= (P90_TOLERANCE.get(name, 0.10) if k.endswith("p90") else 0.10)
                   for k, e in errors.items())

    runs = []
    for attempt in range(2):
        real = validate.real_run(case, "round_robin", tmp_path / f"real-{attempt}")
        assert real["completed"] == sim["completed"] == real["requests"]
        errors = validate.compare(real, sim)
        figures = {f"{k}.{s}": (real[k][s], sim[k][s]) for k, s in validate.FIGURES}
        runs.append((errors, figures))
        print(f"{name} run {attempt}: {errors} {figures}")
        if within(errors):
            return
    pytest.fail(f"{name}: simulated and real differ beyond the tolerance twice: {runs}")
