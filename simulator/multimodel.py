"""Many models on a fleet, in virtual time: each instance is a reference backend hosting
several models (``backend.pooling.Multiplexer``: the same scheduler, memory accounting and
switch costs as ``tokengate backend --models``), placed by token velocity and routed by
residency (``gateway.routing.placement``).

One event per engine step: the instance asks its multiplexer for the next turn, takes the
switch time plus the step's modelled time (``TimingModel``, seeded jitter as the backend's),
then applies the step (tokens sampled, finished requests freed) and plans the next one.
Prompts carry no content, so prefix caching is off: this measures sharing GPUs, not reuse.

With ``FleetConfig.prefill_instances`` the fleet is disaggregated, as Aegaeon's is: that many
instances only prefill (each for the several models it hosts, the same token-level choice of
model per step), the others only decode. A prompt is prefilled on a prefill instance hosting its
model, its KV crosses the link (``latency + prompt KV bytes / bandwidth``), and a decode
instance hosting the model pulls it in (the scheduler's remote-prefill path: the whole prompt
allocated at once, the last prompt token recomputed for the first output token, as vLLM's
P/D does). The client's first token is the decode instance's. The two groups are placed
separately: prefill instances by the models' prompt tokens per second, decode instances by
their output tokens per second.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from backend.model_slot import capacity_bytes, new_slot, pool_blocks
from backend.pooling import MODES, Mode, Multiplexer, Turn
from backend.request import RemotePrefill, Request
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
    # prefill/decode disaggregation: this many of ``instances`` only prefill, the rest only
    # decode (0: every instance does both); the KV link between them
    prefill_instances: int = 0
    kv_link_bps: float = 200e9
    kv_link_latency_s: float = 100e-6

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"pooling must be one of {', '.join(MODES)}, not {self.mode!r}")
        if self.prefill_instances and not 0 < self.prefill_instances < self.instances:
            raise ValueError("prefill/decode disaggregation needs at least one prefill and "
                             f"one decode instance, not {self.prefill_instances} of "
                             f"{self.instances}")


class SimInstance:
    """One pooled instance on the event loop."""

    def __init__(self, name: str, models: Sequence[str], cfg: FleetConfig,
                 loop: EventLoop, seed: int, misses: list[int] | None = None,
                 handoff: Callable[[ModelRequest], None] | None = None,
                 decodes: bool = False) -> None:
        """``handoff``: a prefill instance, which hands each prompt it has prefilled to it;
        ``decodes``: a decode instance, whose requests arrive prefilled."""
        self.name = name
        self.loop = loop
        self.handoff = handoff
        self.decodes = decodes
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

    def submit(self, mr: ModelRequest, since: float | None = None) -> None:
        """``mr`` arrives (on a decode instance: prefilled elsewhere, its KV in transit
        since ``since``)."""
        now = self.loop.now
        if since is None:
            causes.charge(mr.lost, "path", now - mr.t)
        else:
            causes.charge(mr.lost, "transfer", now - since)
        if self.busy:  # what is left of the step under way
            switch_end, end, model, prompt = self.current
            causes.step([(mr, mr.model == model, False)],
                        max(0.0, switch_end - now), end - max(now, switch_end), prompt)
        out = 1 if self.handoff is not None else mr.output_tokens  # prefill: the first token
        req = Request(str(mr.rid), [0] * mr.prompt_tokens, out, out, mr.t + self.path[0],
                      model=mr.model)
        if self.decodes:
            req.remote_prefill = RemotePrefill({})
        mr.instance = self.name
        self.live[req.request_id] = mr
        if not self.decodes:
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
        if turn is not None and turn.plan.transfers:
            # a decode instance: the KV was on its way when the request arrived (the link's
            # time is charged before); the pull completes as its blocks are allocated
            for req in turn.plan.transfers:
                turn.slot.scheduler.remote_kv_ready(req, True)
            if turn.plan.empty and not turn.switch_s:
                self._step()  # they can be scheduled now
                return
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
            if self.handoff is not None:  # prefilled: on to a decode instance
                assert status is not None
                sched.finish(req, status)
                del self.live[req.request_id]
                self.handoff(mr)
                continue
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
    clock: float = 0.0  # when the simulation ended (given up: then, not at the last arrival)

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
        # which SLO the misses broke: the first token's (its deadline passed without it, or
        # it came late) or the pace of the others'
        late = [r for r in reqs if (r.ttft is None and r.t + ttft_s <= self.clock)
                or (r.ttft is not None and r.ttft > ttft_s)]
        slow = sum(1 for r in reqs if r.ttft is not None and r.ttft <= ttft_s
                   and r.tpot is not None and r.tpot > tpot_s)
        prefill = [i for i in self.instances if i.handoff is not None]
        # disaggregated: a late first token is the prefill side's when it waited longer there
        # (beyond its own prefill) than at the decode side (beyond the KV's crossing)
        at_prefill = sum(1 for r in late if r.prefilled is None
                         or r.prefilled - r.t - r.lost.get("own_prefill", 0.0)
                         > (r.first_token or self.clock) - r.prefilled
                         - r.lost.get("transfer", 0.0))
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
            "ttft_misses": len(late), "tpot_misses": slow,
            "ttft_misses_in_prefill": at_prefill if prefill else None,
            "prefill_instances": len(prefill),
            # disaggregated: each group's busy share
            "utilisation_prefill": _busy(prefill, span),
            "utilisation_decode": _busy([i for i in self.instances if i.decodes], span),
            "causes_ms": causes.summary(reqs, ttft_s, tpot_s),
        }

    @property
    def gpus(self) -> int:
        return len(self.instances) * max(self.instances[0].mux.slots[0].profile
                                         .tensor_parallel, 1)


def _busy(group: Sequence[SimInstance], span: float) -> float | None:
    return sum(i.busy_s for i in group) / span / len(group) if group else None


def velocities(requests: Sequence[ModelRequest], tokens: str = "all") -> dict[str, float]:
    """Tokens per second each model is asked for over the workload: prompt and output
    ``tokens``, or only the ``"prompt"`` or only the ``"output"`` ones."""
    span = max((r.t for r in requests), default=0.0) or 1.0
    v: dict[str, float] = {}
    for r in requests:
        n = (r.prompt_tokens if tokens != "output" else 0) \
            + (r.output_tokens if tokens != "prompt" else 0)
        v[r.model] = v.get(r.model, 0.0) + n / span
    return v


def run_fleet(requests: Sequence[ModelRequest], cfg: FleetConfig,
              max_misses: int | None = None) -> FleetResult:
    """Serve ``requests`` (fresh copies: the inputs are left untouched) on the fleet; with
    ``max_misses``, give up as soon as more requests than that missed the SLO (an overloaded
    fleet's queues would otherwise take long to simulate, for an answer already known)."""
    reqs = [ModelRequest(r.rid, r.model, r.t, r.prompt_tokens, r.output_tokens)
            for r in requests]
    per = 1 if cfg.mode == "dedicated" else cfg.per_instance
    loop = EventLoop()
    misses = [0]  # shared by every instance
    first = next(iter(velocities(reqs)))
    pre = cfg.prefill_instances
    if pre:
        hosts = placement(velocities(reqs, "prompt"), pre, per) \
            + placement(velocities(reqs, "output"), cfg.instances - pre, per)
    else:
        hosts = placement(velocities(reqs), cfg.instances, per)
    kv_bits = cfg.profile.kv_bytes_per_token * 8

    def handoff(mr: ModelRequest) -> None:  # a prompt prefilled: its KV to a decode instance
        now = mr.prefilled = loop.now
        link = cfg.kv_link_latency_s + mr.prompt_tokens * kv_bits / cfg.kv_link_bps
        loop.after(link, route, mr, decoders, now)

    insts = [SimInstance(f"i{k}", h or [first], cfg, loop, cfg.seed * 1000 + k, misses,
                         handoff=handoff if k < pre else None, decodes=pre > 0 and k >= pre)
             for k, h in enumerate(hosts)]

    def homes(group: Sequence[SimInstance], hosted: Sequence[list[str]]
              ) -> dict[str, list[SimInstance]]:
        out: dict[str, list[SimInstance]] = {}
        for inst_, models in zip(group, hosted, strict=True):
            for m in models:
                out.setdefault(m, []).append(inst_)
        return out

    entry = homes(insts[:pre or None], hosts[:pre or None])
    decoders = homes(insts[pre:], hosts[pre:]) if pre else {}

    def route(mr: ModelRequest, group: dict[str, list[SimInstance]],
              since: float | None = None) -> None:
        inst = pick(mr.model, [i.view() for i in group.get(mr.model, ())])
        if inst is None:
            raise ValueError(f"no instance hosts {mr.model}")
        insts[int(inst.name[1:])].submit(mr, since)

    def arrive(mr: ModelRequest) -> None:
        route(mr, entry)

    for mr in reqs:
        loop.at(mr.t + cfg.path_in_s, arrive, mr)
    over = (lambda: misses[0] > max_misses) if max_misses is not None else None
    loop.run(stop=over)
    end = max((r.done for r in reqs if r.done is not None), default=0.0)
    return FleetResult(reqs, insts, hosts, max(end, max((r.t for r in reqs), default=0.0)),
                       stopped=over is not None and over(), clock=loop.now)
