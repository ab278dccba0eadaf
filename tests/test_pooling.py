"""Several models on one instance (``backend.pooling``): switch costs pinned to the profiles,
the three scheduling policies, and the memory budget shared by weights and KV.

The multiplexer is driven here as the engine loop drives it, in virtual time: ask for a turn,
advance the clock by the switch plus the step's modelled time, apply the step."""

from __future__ import annotations

import dataclasses
import random

import pytest

from backend.model_slot import capacity_bytes, new_slot, pool_blocks
from backend.pooling import QUANTUM, Multiplexer
from backend.request import Request
from protocol.kv_hash import root_hash
from roofline.profiles import HARDWARE, MODELS, ModelProfile
from roofline.switching import SwitchCost
from roofline.timing import TimingModel

H100 = HARDWARE["h100-sxm"]
SMALL = MODELS["llama-3-8b"]  # 16 GB of weights: four fit on an H100 with room for KV
BIG = dataclasses.replace(SMALL, name="big-20b", params=20e9)  # 40 GB: one at a time


def mux(profiles: list[ModelProfile], mode: str = "token", **kw: object) -> Multiplexer:
    cap = capacity_bytes(H100, 0.9)
    slots = [new_slot(f"m{i}", p, H100, pool_blocks(p, cap, 16), root_hash(f"m{i}"),
                      jitter=0.0)
             for i, p in enumerate(profiles)]
    return Multiplexer(slots, mode=mode, hardware=H100, capacity=cap,  # type: ignore[arg-type]
                       **kw)  # type: ignore[arg-type]


class Driver:
    """The engine loop in virtual time; records every turn and every request's tokens."""

    def __init__(self, m: Multiplexer, scale: float = 1.0) -> None:
        self.m = m
        self.scale = scale  # clock seconds per modelled second (the engine's time_scale)
        self.now = 0.0
        self.turns: list[tuple[str, float, float]] = []  # model, start, switch seconds
        self.first: dict[str, float] = {}
        self.done: dict[str, float] = {}
        self.dropped: list[str] = []
        self.reqs: dict[str, Request] = {}

    def add(self, model: str, rid: str, prompt: int = 200, out: int = 50) -> Request:
        token = len(self.reqs) + 1  # distinct prompts: no prefix is shared
        req = Request(rid, [token] * prompt, out, out, self.now, model=model)
        self.reqs[rid] = req
        self.m.by_name[model].scheduler.add(req)
        return req

    def step(self) -> bool:
        turn = self.m.next(self.now)
        if turn is None:
            return False
        assert self.m.free_bytes() >= -1.0, "weights and KV exceed the GPU's memory"
        self.turns.append((turn.slot.name, self.now, turn.switch_s))
        self.dropped += [r.request_id for r in turn.dropped]
        self.now += turn.switch_s * self.scale
        if not turn.plan.empty:
            self.now += turn.slot.timing.step_seconds(turn.plan.work(),
                                                      turn.plan.num_sampled()) * self.scale
        sched = turn.slot.scheduler
        for req in sched.update(turn.plan):
            status = req.append_output(0)
            if req.first_token_time is None:
                req.first_token_time = self.now
                self.first[req.request_id] = self.now
            if status is not None:
                sched.finish(req, status)
                self.done[req.request_id] = self.now
        return True

    def run(self, until: float = 1e9) -> None:
        while self.now < until and self.step():
            pass


def test_a_switch_costs_the_weights_over_pcie_and_nothing_when_resident() -> None:
    m = mux([BIG, BIG])
    d = Driver(m)
    assert m.resident() == ["m0"]  # the second does not fit beside the first
    d.add("m1", "a")
    d.step()
    name, _, switch = d.turns[0]
    want = BIG.weight_bytes / H100.pcie_bandwidth + SwitchCost().optimised_overhead_s
    assert name == "m1" and switch == pytest.approx(want)  # 40 GB / 50 GB/s + 10 ms = 0.81 s
    assert m.resident() == ["m1"] and m.stats.weight_evictions == 1
    assert d.first["a"] >= want  # no token before the weights are in

    disk = SwitchCost(source="disk", optimised=False)
    assert disk.load_seconds(BIG, H100) == pytest.approx(40e9 / 6e9 + 2.5)

    both = mux([SMALL, SMALL])
    assert both.resident() == ["m0", "m1"]
    d2 = Driver(both)
    d2.add("m1", "b")
    d2.add("m0", "c")
    d2.run()
    assert all(s == 0.0 for _, _, s in d2.turns) and both.stats.switches == 0


def test_request_pooling_switches_only_when_the_batch_has_drained() -> None:
    m = mux([BIG, BIG], mode="request")
    d = Driver(m)
    d.add("m0", "a", out=40)
    d.step()
    d.add("m1", "b", out=10)
    d.run()
    assert d.first["b"] > d.done["a"]  # b waited for a's whole batch
    assert [t[0] for t in d.turns].index("m1") == len([t for t in d.turns if t[0] == "m0"])


def test_token_pooling_serves_another_model_between_steps_within_the_tpot_slo() -> None:
    m = mux([BIG, BIG], mode="token", tpot_slo_s=0.05)
    d = Driver(m)
    d.add("m0", "a", out=400)
    d.step()
    d.add("m1", "b", out=400)
    d.run()
    assert d.first["b"] < d.done["a"]  # b did not wait for a to finish
    assert m.stats.switches >= 2  # and a got the GPU back
    for rid in ("a", "b"):
        tpot = (d.done[rid] - d.first[rid]) / 399
        assert tpot <= 0.05, f"{rid}: average TPOT {tpot * 1e3:.1f} ms over the SLO"
    one = m.load_seconds("m0") or m.load_seconds("m1")
    assert m.stats.switch_s <= d.now / (1 + QUANTUM) + one  # loads amortised by the quantum


def test_kv_of_a_switched_out_model_stays_while_memory_allows() -> None:
    m = mux([SMALL, SMALL])
    d = Driver(m)
    d.add("m0", "a", out=300)
    for _ in range(5):
        d.step()
    d.add("m1", "b", out=300)
    d.run()
    assert not d.dropped and d.reqs["a"].num_preemptions == 0


def test_kv_is_dropped_and_recomputed_when_the_next_model_needs_the_memory() -> None:
    # Two 30 GB models on 74.7 GB. m0's requests hold ~40 GB of KV; switching m1 in evicts
    # m0's weights first and then, still short of 30 GB + m1's prompt, drops m0's KV.
    big30 = dataclasses.replace(SMALL, name="big-15b", params=15e9)
    per = int(10e9 // SMALL.kv_bytes_per_token)  # ~10 GB of KV each
    # a TTFT SLO that b's long prompt can still make, 1 s to spare, and m0's decodes within
    # their TPOT (1 s): b soon becomes the most urgent (a prompt that could not make its SLO
    # would be served best effort, after m0's decodes, and need no drop)
    prefill = TimingModel(big30, H100, jitter=0.0).prefill_seconds(per, 8192)
    m = mux([big30, big30], mode="token", ttft_slo_s=prefill + 1.0, tpot_slo_s=1.0)
    d = Driver(m)
    for i in range(4):
        d.add("m0", f"a{i}", prompt=per, out=400)
    while not all(f"a{i}" in d.first for i in range(4)):
        d.step()
    d.add("m1", "b", prompt=per, out=50)
    d.run()
    assert any(r.startswith("a") for r in d.dropped)
    assert sum(d.reqs[f"a{i}"].num_preemptions for i in range(4)) >= 1
    assert set(d.done) == {"a0", "a1", "a2", "a3", "b"}  # a's recomputed and finished
    assert m.stats.kv_drops >= 1 and m.stats.weight_evictions >= 1


def test_a_prompt_past_its_ttft_slo_does_not_make_the_others_wait() -> None:
    """A prompt whose prefill alone would end past the TTFT SLO misses it whatever is done;
    it is served best effort, after the prompt of another model that can still make it, not
    before it as the most urgent of all (its deadline, arrival + SLO - prefill, is in the
    past)."""
    m = mux([SMALL, SMALL], mode="token", ttft_slo_s=0.5)
    d = Driver(m)
    d.add("m0", "long", prompt=60_000, out=4)  # its prefill alone takes over 0.5 s
    d.add("m1", "short", prompt=500, out=4)
    d.run()
    assert set(d.done) == {"long", "short"}
    assert d.first["short"] < d.first["long"]
    assert d.first["short"] - d.reqs["short"].arrival_time <= 0.5


def random_mix(d: Driver, rng: random.Random, n: int, prompt: int, out: int, steps: int
               ) -> None:
    """``n`` requests for random models of the four, random steps between them, then to
    the end."""
    for i in range(n):
        d.add(f"m{rng.randrange(4)}", f"r{i}", prompt=rng.randint(10, prompt),
              out=rng.randint(1, out))
        for _ in range(rng.randint(0, steps)):
            d.step()
    d.run()


def test_memory_is_never_overcommitted_under_a_random_mix() -> None:
    m = mux([BIG, SMALL, SMALL, BIG], mode="token")
    d = Driver(m)
    random_mix(d, random.Random(3), 60, 4000, 200, 30)
    assert len(d.done) == 60
    assert all(s.used_blocks == 0 for s in m.slots)


@pytest.mark.parametrize("mode", ["token", "request"])
def test_a_time_scaled_engine_takes_the_same_decisions(mode: str) -> None:
    """An engine run at ``time_scale`` k (kernels and switches k times slower, its clock
    k times further on) decides exactly as at k = 1: the same models in the same turns, at
    k times the times. Deadlines, the hold after a switch and the step's start are compared
    with that clock, so they are scaled with it."""
    def run(k: float) -> tuple[list[tuple[str, float, float]], dict[str, float]]:
        d = Driver(mux([BIG, SMALL, SMALL, BIG], mode=mode, time_scale=k), scale=k)
        random_mix(d, random.Random(5), 40, 3000, 150, 20)
        return d.turns, d.first

    base_turns, base_first = run(1.0)
    turns, first = run(7.0)
    assert [(n, sw) for n, _, sw in turns] == [(n, sw) for n, _, sw in base_turns]
    assert all(abs(t - 7.0 * b) < 1e-6
               for (_, t, _), (_, b, _) in zip(turns, base_turns, strict=True))
    assert first.keys() == base_first.keys()
    assert all(abs(first[r] - 7.0 * base_first[r]) < 1e-6 for r in first)


def test_a_prefetched_load_takes_the_same_turn_and_no_gpu_time() -> None:
    """The benchmark's bound (perfect foresight): a load started ahead costs the GPU nothing,
    while the scheduler weighs it as before, so the first turn is the same model with the
    same resident set, its first token comes a whole load earlier, and a mix still ends."""
    def first_turn(switch: SwitchCost) -> tuple[Driver, Multiplexer]:
        m = mux([BIG, BIG], switch=switch)
        d = Driver(m)
        d.add("m1", "a")
        d.step()
        return d, m

    real, rm = first_turn(SwitchCost())
    pre, pm = first_turn(SwitchCost(prefetched=True))
    load = real.turns[0][2]
    assert load > 0.5 and pre.turns[0] == ("m1", 0.0, 0.0)
    assert pm.resident() == rm.resident() == ["m1"] and pm.stats.switches == 1
    assert pre.first["a"] == pytest.approx(real.first["a"] - load)

    d = Driver(mux([BIG, SMALL, SMALL, BIG], switch=SwitchCost(prefetched=True)))
    random_mix(d, random.Random(9), 40, 3000, 150, 20)
    assert len(d.done) == 40 and d.m.stats.switches > 0
    assert all(sw == 0.0 for _, _, sw in d.turns)


def test_bad_configurations_are_refused() -> None:
    with pytest.raises(ValueError, match="dedicated"):
        mux([SMALL, SMALL], mode="dedicated")
    with pytest.raises(ValueError, match="pooling mode"):
        mux([SMALL], mode="bogus")
    with pytest.raises(ValueError, match="tensor parallelism"):
        mux([SMALL, dataclasses.replace(SMALL, tensor_parallel=2)])
    with pytest.raises(ValueError, match="weights source"):
        SwitchCost(source="tape")  # type: ignore[arg-type]
