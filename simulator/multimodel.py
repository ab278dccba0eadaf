"""Many models on a fleet, in virtual time: each instance is a reference backend hosting
several models (``backend.pooling.Multiplexer``: the same scheduler, memory accounting and
switch costs as ``tokengate backend --models``), placed by token velocity and routed by
residency (``gateway.routing.placement``).

One event per engine step: the instance asks its multiplexer for the next turn, takes the
switch time plus the step's modelled time (``TimingModel``, seeded jitter as the backend's),
then applies the step (tokens sampled, finished requests freed) and plans the next one.
Prompts carry no content, so prefix caching is off: this measures sharing GPUs, not reuse.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from backend.model_slot import capacity_bytes, new_slot, pool_blocks
from backend.pooling import MODES, Mode, Multiplexer, Turn
from backend.request import Request
from gateway.routing.placement import InstanceView, pick, placement
from protocol.kv_hash import root_hash
from roofline.profiles import HardwareProfile, ModelProfile
from roofline.switching import SwitchCost
from simulator import causes
from simulator.events import EventLoop
from simulator.longtail import ModelRequest


@dataclass(slots=True)
class FleetConfig:
    instances: int
    mode: Mode
    profile: ModelProfile
    hardware: HardwareProfile
    per_instance: int = 8  # models an instance hosts (what its host memory holds)
    switch: SwitchCost = field(default_factory=SwitchCost)
    ttft_slo_s: float = 2.0
    tpot_slo_s: float = 0.05
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    gpu_memory_utilization: float = 0.9
    jitter: float = 0.03
    seed: int = 0
    # the fixed path between a client and the engine (its HTTP, the gateway, event loops): a
    # request reaches the engine ``path_in_s`` after it is sent, and each token the client
    # ``path_out_s`` after the engine emits it (TTFT counts both; the SLO is the client's)
    path_in_s: float = 0.0
    path_out_s: float = 0.0

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"pooling must be one of {', '.join(MODES)}, not {self.mode!r}")


class SimInstance:
    """One pooled instance on the event loop."""

    def __init__(self, name: str, models: Sequence[str], cfg: FleetConfig,
                 loop: EventLoop, seed: int, misses: list[int] | None = None) -> None:
        self.name = name
        self.loop = loop
        cap = capacity_bytes(cfg.hardware, cfg.gpu_memory_utilization)
        blocks = pool_blocks(cfg.profile, cap, 16)
        if blocks <= 0:
            raise ValueError(f"{cfg.profile.name} does not fit on {cfg.hardware.name}")
        slots = [new_slot(m, cfg.profile, cfg.hardware, blocks, root_hash(m),
                          max_num_batched_tokens=cfg.max_num_batched_tokens,
                          max_num_seqs=cfg.max_num_seqs, enable_caching=False,
                          jitter=cfg.jitter, seed=seed + k, record_events=False)
                 for k, m in enumerate(models)]
        mode: Mode = "dedicated" if len(slots) == 1 else cfg.mode
        self.mux = Multiplexer(slots, mode=mode, hardware=cfg.hardware, capacity=cap,
                               switch=cfg.switch, ttft_slo_s=cfg.ttft_slo_s,
                               tpot_slo_s=cfg.tpot_slo_s)
        self.busy = False
        self.busy_s = 0.0
        # the step under way: (its switch ends, it ends, its model, it computes prompt tokens)
        self.current: tuple[float, float, str, bool] = (0.0, 0.0, "", False)
        self.steps = 0
        self.live: dict[str, ModelRequest] = {}
        self.slo = (cfg.ttft_slo_s, cfg.tpot_slo_s)
        self.path = (cfg.path_in_s, cfg.path_out_s)
        self.misses = misses if misses is not None else [0]  # requests known to miss the SLO

    def view(self) -> InstanceView:
        queued = 0.0
        for s in self.mux.slots:
            tokens = sum(r.num_prompt_tokens - r.num_computed_tokens
                         for r in s.scheduler.waiting)
            if tokens:
                queued += s.timing.prefill_seconds(tokens, s.scheduler.config
                                                   .max_num_batched_tokens)
            if s.scheduler.running:
                queued += s.timing.decode_step_seconds(len(s.scheduler.running), 1024)
        return InstanceView(self.name, frozenset(self.mux.by_name),
                            frozenset(self.mux.resident()),
                            {m: self.mux.wait_seconds(m) for m in self.mux.by_name}, queued)

    def submit(self, mr: ModelRequest) -> None:
        now = self.loop.now
        causes.charge(mr.lost, "path", now - mr.t)
        if self.busy:  # what is left of the step under way
            switch_end, end, model, prompt = self.current
            causes.step([(mr, mr.model == model, False)],
                        max(0.0, switch_end - now), end - max(now, switch_end), prompt)
        req = Request(str(mr.rid), [0] * mr.prompt_tokens, mr.output_tokens, mr.output_tokens,
                      self.loop.now, model=mr.model)
        mr.instance = self.name
        self.live[req.request_id] = mr
        self.loop.after(max(0.0, self.slo[0] - self.path[0] - self.path[1]), self._late, mr)
        self.mux.by_name[mr.model].scheduler.add(req)
        if not self.busy:
            self._step()

    def _late(self, mr: ModelRequest) -> None:
        """Its TTFT deadline passed: without a first token by now it misses the SLO."""
        if mr.first_token is None:
            self.misses[0] += 1

    def _step(self) -> None:
        turn = self.mux.next(self.loop.now)
        if turn is None or (turn.plan.empty and not turn.switch_s):
            self.busy = False
            return
        self.busy = True
        plan = turn.plan
        compute = 0.0
        if not plan.empty:
            compute = turn.slot.timing.step_seconds(plan.work(), plan.num_sampled())
        dur = turn.switch_s + compute
        self.busy_s += dur
        self.steps += 1
        self._charge(turn, compute)
        self.loop.after(dur, self._done, turn)

    def _charge(self, turn: Turn, compute: float) -> None:
        """This step's time, to each live request's causes (``simulator.causes``)."""
        model = turn.slot.name
        ids = {r.request_id for r, _, _ in turn.plan.scheduled}
        prompt = any(ctx < r.num_prompt_tokens for r, _, ctx in turn.plan.scheduled)
        now = self.loop.now
        self.current = (now + turn.switch_s, now + turn.switch_s + compute, model, prompt)
        causes.step(((mr, mr.model == model, rid in ids)
                     for rid, mr in self.live.items()), turn.switch_s, compute, prompt)

    def _done(self, turn: Turn) -> None:
        now = self.loop.now
        seen = now + self.path[1]  # when the client has the tokens
        sched = turn.slot.scheduler
        for req in sched.update(turn.plan):
            mr = self.live[req.request_id]
            status = req.append_output(0)
            if mr.first_token is None:
                req.first_token_time = now
                mr.first_token = seen
            mr.tokens += 1
            if status is not None:
                sched.finish(req, status)
                mr.done = seen
                del self.live[req.request_id]
                tpot = mr.tpot
                if mr.ttft is not None and mr.ttft <= self.slo[0] and tpot is not None \
                        and tpot > self.slo[1]:
                    self.misses[0] += 1
        self._step()


@dataclass(slots=True)
class FleetResult:
    requests: list[ModelRequest]
    instances: list[SimInstance]
    hosts: list[list[str]]
    virtual_s: float
    stopped: bool = False  # given up once more requests missed the SLO than allowed

    def summary(self, ttft_s: float, tpot_s: float) -> dict[str, Any]:
        reqs = self.requests
        met = [r.meets(ttft_s, tpot_s) for r in reqs]
        ttft = np.array([r.ttft for r in reqs if r.ttft is not None]) * 1e3
        tpot = np.array([r.tpot for r in reqs if r.tpot is not None]) * 1e3
        switches = sum(i.mux.stats.switches for i in self.instances)
        span = max(self.virtual_s, 1e-9)
        good_tokens = sum(r.output_tokens for r, ok in zip(reqs, met, strict=True) if ok)

        def pct(a: np.ndarray, q: float) -> float | None:
            return float(np.percentile(a, q)) if len(a) else None

        misses = self.instances[0].misses[0] if self.instances else 0
        attainment = 1.0 - misses / len(reqs) if self.stopped and reqs else (
            float(np.mean(met)) if met else 1.0)
        return {
            "instances": len(self.instances),
            "requests": len(reqs),
            # a run given up early: the most it could still have reached
            "attainment": attainment,
            "stopped_early": self.stopped,
            "completed": sum(r.done is not None for r in reqs),
            "ttft_p50_ms": pct(ttft, 50), "ttft_p99_ms": pct(ttft, 99),
            "tpot_p50_ms": pct(tpot, 50), "tpot_p99_ms": pct(tpot, 99),
            "goodput_tokens_per_s_per_gpu": good_tokens / span / self.gpus,
            "switches": switches,
            "switch_s": sum(i.mux.stats.switch_s for i in self.instances),
            "kv_drops": sum(i.mux.stats.kv_drops for i in self.instances),
            "utilisation": sum(i.busy_s for i in self.instances) / span / len(self.instances),
            # placement's imbalance: the busiest instance's busy time over the mean's
            "busy_max_over_mean": max(i.busy_s for i in self.instances) / max(
                sum(i.busy_s for i in self.instances) / len(self.instances), 1e-12),
            "models_per_instance": max(len(h) for h in self.hosts),
            "causes_ms": causes.summary(reqs, ttft_s, tpot_s),
        }

    @property
    def gpus(self) -> int:
        return len(self.instances) * max(self.instances[0].mux.slots[0].profile
                                         .tensor_parallel, 1)


def velocities(requests: Sequence[ModelRequest]) -> dict[str, float]:
    """Tokens per second each model is asked for over the workload."""
    span = max((r.t for r in requests), default=0.0) or 1.0
    v: dict[str, float] = {}
    for r in requests:
        v[r.model] = v.get(r.model, 0.0) + (r.prompt_tokens + r.output_tokens) / span
    return v


def run_fleet(requests: Sequence[ModelRequest], cfg: FleetConfig,
              max_misses: int | None = None) -> FleetResult:
    """Serve ``requests`` (fresh copies: the inputs are left untouched) on the fleet; with
    ``max_misses``, give up as soon as more requests than that missed the SLO (an overloaded
    fleet's queues would otherwise take long to simulate, for an answer already known)."""
    reqs = [ModelRequest(r.rid, r.model, r.t, r.prompt_tokens, r.output_tokens)
            for r in requests]
    per = 1 if cfg.mode == "dedicated" else cfg.per_instance
    hosts = placement(velocities(reqs), cfg.instances, per)
    loop = EventLoop()
    misses = [0]  # shared by every instance
    insts = [SimInstance(f"i{k}", h or [next(iter(velocities(reqs)))], cfg, loop,
                         cfg.seed * 1000 + k, misses) for k, h in enumerate(hosts)]

    homes: dict[str, list[SimInstance]] = {}
    for inst_, hosted in zip(insts, hosts, strict=True):
        for m in hosted:
            homes.setdefault(m, []).append(inst_)

    def arrive(mr: ModelRequest) -> None:
        inst = pick(mr.model, [i.view() for i in homes.get(mr.model, ())])
        if inst is None:
            raise ValueError(f"no instance hosts {mr.model}")
        insts[int(inst.name[1:])].submit(mr)

    for mr in reqs:
        loop.at(mr.t + cfg.path_in_s, arrive, mr)
    over = (lambda: misses[0] > max_misses) if max_misses is not None else None
    loop.run(stop=over)
    end = max((r.done for r in reqs if r.done is not None), default=0.0)
    return FleetResult(reqs, insts, hosts, max(end, max((r.t for r in reqs), default=0.0)),
                       stopped=over is not None and over())


def fewest_gpus(requests: Sequence[ModelRequest], base: FleetConfig, target: float,
                max_instances: int, log: Any = None) -> tuple[int | None, list[dict[str, Any]]]:
    """The fewest instances whose SLO attainment reaches ``target``, with every trial.

    Attainment is taken as non-decreasing in instances. The search gallops up from the fewest
    instances that can host every model (doubling until one suffices), then bisects: a trial
    that falls short stops early and is cheap, one with many instances is not, so the largest
    size tried is at most twice the answer rather than ``max_instances``."""
    trials: list[dict[str, Any]] = []
    cache: dict[int, float] = {}

    def attain(n: int) -> float:
        if n not in cache:
            cfg = FleetConfig(**{**{f: getattr(base, f) for f in base.__dataclass_fields__},
                                 "instances": n})
            res = run_fleet(requests, cfg, int((1.0 - target) * len(requests)))
            row = res.summary(base.ttft_slo_s, base.tpot_slo_s)
            row["gpus"] = res.gpus
            trials.append(row)
            cache[n] = row["attainment"]
            if log is not None:
                log(row)
        return cache[n]

    models = len({r.model for r in requests})
    per = 1 if base.mode == "dedicated" else base.per_instance
    lo = max(1, math.ceil(models / per))
    hi = max(lo, max_instances)
    if attain(lo) >= target:
        return lo, trials  # the fewest that can host every model already suffice
    while True:
        step = min(hi, 2 * lo)
        if attain(step) >= target:
            lo, hi = lo + 1, step
            break
        if step == hi:
            return None, trials
        lo = step + 1
    while lo < hi:
        mid = (lo + hi) // 2
        if attain(mid) >= target:
            hi = mid
        else:
            lo = mid + 1
    return hi, trials
