"""Decode runs (``simulator.decode_run``) change how fast the simulator goes, never what it
computes: with them and without, an engine takes the same steps of the same durations, emits
the same tokens at the same times, preempts the same requests, and a whole simulation
(prefix-affine sessions on a precise index, a prefill/decode pool) reports the same
numbers."""

from __future__ import annotations

import dataclasses
import random
from typing import Any

from backend.engine_config import EngineConfig
from backend.request import Request
from loadtests import workloads
from roofline.profiles import HARDWARE, MODELS
from simulator.engine import Hooks, SimEngine
from simulator.events import EventLoop
from simulator.run import SimConfig, simulate
from simulator.workload import WorkloadSpec
from stack.pool_shape import PoolShape

MODEL, HW = MODELS["llama-3-8b"], HARDWARE["h100-sxm"]


def _engine_run(fast_forward: bool, blocks: int) -> dict[str, Any]:
    cfg = EngineConfig(max_num_batched_tokens=512, num_gpu_blocks=blocks, jitter=0.03, seed=3)
    loop = EventLoop()
    e = SimEngine("e", MODEL, HW, cfg, loop, root=1, fast_forward=fast_forward)
    rng = random.Random(5)
    tokens: dict[str, list[float]] = {}
    finished: dict[str, tuple[float, int, int]] = {}
    for i in range(60):
        ids = [7] * 32 + [rng.randint(0, 50) for _ in range(rng.randint(20, 400))]
        out = rng.randint(2, 300)
        hooks = Hooks(lambda r, t, first: tokens.setdefault(r.request_id, []).append(t),
                      lambda r, t: finished.__setitem__(
                          r.request_id, (t, r.num_output_tokens, r.num_preemptions)))
        loop.at(rng.random() * 3.0, e.submit, Request(f"r{i}", ids, out, out, 0.0), hooks)
    probes: list[tuple[float, float, int, int]] = []

    def probe() -> None:  # what a scrape reads, every 13.7 ms (mid-step, mostly)
        e.sync()
        probes.append((loop.now, e.kv_usage(), e.running, e.waiting))
        if loop.now < 20:
            loop.after(0.0137, probe)

    loop.at(0.0, probe)
    loop.run()
    return {"tokens": tokens, "finished": finished, "probes": probes,
            "steps": e.stats.steps, "busy": e.stats.busy_s,
            "preemptions": e.stats.preemptions, "events": loop.processed}


def test_an_engine_under_kv_pressure_steps_the_same_with_decode_runs() -> None:
    for blocks in (120, 2000):  # preempting often; never
        step, run = _engine_run(False, blocks), _engine_run(True, blocks)
        for key in ("tokens", "finished", "probes", "steps", "busy", "preemptions"):
            assert run[key] == step[key], (blocks, key)
        assert len(run["finished"]) == 60
        assert run["events"] < step["events"]  # runs did replace step events
    assert _engine_run(True, 120)["preemptions"] > 0


def _same(cfg: SimConfig) -> tuple[int, int]:
    a = simulate(dataclasses.replace(cfg, fast_forward=False))
    b = simulate(cfg)
    assert [(r.endpoint, r.prefill_endpoint, r.chunk_times, r.error) for r in a.run.results] \
        == [(r.endpoint, r.prefill_endpoint, r.chunk_times, r.error) for r in b.run.results]
    for url, e in a.engines.items():
        f = b.engines[url]
        assert (e.stats.steps, e.stats.busy_s, e.kv.stats.hits, e.pool.num_free) == \
            (f.stats.steps, f.stats.busy_s, f.kv.stats.hits, f.pool.num_free)
    assert a.report["simulation"]["predictor"] == b.report["simulation"]["predictor"]
    return a.report["simulation"]["events"], b.report["simulation"]["events"]


def test_a_simulation_reports_the_same_with_decode_runs() -> None:
    sessions = WorkloadSpec("sessions", requests=80, rate=2.0, seed=1,
                            sessions=workloads.SessionSpec(
                                sessions=10, turns=8, agent_types=3, system_tokens=400,
                                task_tokens=100, tool_tokens=800, think_time_s=0.5,
                                output=workloads.parse_lengths("uniform:20:120", "output")))
    base = {"model": "llama-3-8b", "hardware": "h100-sxm", "no_quota": True}
    step_events, run_events = _same(SimConfig(sessions, shape=PoolShape(
        strategy="predicted", index="precise", backends=3, **base)))  # type: ignore[arg-type]
    assert run_events < 0.5 * step_events
    synthetic = WorkloadSpec("synthetic", requests=120, rate=14.0, burstiness=0.5, seed=4,
                             input_len="uniform:200:3000", output_len="uniform:8:200")
    _same(SimConfig(synthetic, shape=PoolShape(strategy="predicted", pd="1:2",
                                               **base)))  # type: ignore[arg-type]
    _same(SimConfig(synthetic, hindsight=True, shape=PoolShape(
        strategy="round_robin", backends=3, **base)))  # type: ignore[arg-type]
