"""The flow-control queue's order (bands, fair share, deadlines), its VTC bound, its shedding,
and the gate's saturation and work conservation, as pure functions of their inputs."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from gateway.config.flow import FlowControl
from gateway.config.policy import Model
from gateway.flow.fair import FairQueue
from gateway.flow.gate import Gate
from gateway.flow.waiter import Waiter
from gateway.routing.endpoints import EndpointPool, EndpointState


def w(flow: str, band: str = "standard", deadline: float = 0.0, cin: float = 100,
      cout: float = 10, weight: float = 1.0) -> Waiter:
    return Waiter(flow, band, deadline, cin, cout, weight)


def test_bands_come_first_then_deadlines_within_a_flow() -> None:
    q = FairQueue("fair")
    late, early = w("a", deadline=5), w("a", deadline=1)
    flex, crit = w("b", "flex"), w("c", "critical", deadline=9)
    for x in (flex, late, early, crit):
        assert q.push(x) is None
    assert [q.pop() for _ in range(4)] == [crit, early, late, flex]
    assert q.pop() is None and q.size == 0


def test_fair_share_goes_to_the_least_served_flow_and_weights_scale_it() -> None:
    q = FairQueue("fair", w_in=1, w_out=2)
    for i in range(3):
        q.push(w("heavy", deadline=i))
    q.push(w("light", deadline=9))
    q.charge("heavy", 10_000, 1_000)  # served while both waited
    assert q.pop().flow == "light"  # type: ignore[union-attr]
    # a weight of 4 makes the same tokens count a quarter
    q2 = FairQueue("fair")
    q2.push(w("plain"))
    q2.push(w("gold"))
    q2.charge("gold", 4000, 0, weight=4.0)
    q2.charge("plain", 1001, 0)
    assert q2.pop().flow == "gold"  # type: ignore[union-attr]


def test_an_idle_flow_cannot_bank_credit() -> None:
    q = FairQueue("fair")
    q.charge("busy", 50_000, 0)
    q.push(w("busy"))
    q.push(w("idle"))  # it arrives with a counter of 0: lifted to the backlogged minimum
    assert q.counters["idle"] == q.counters["busy"] == 50_000


def test_fcfs_priority_and_round_robin_orders() -> None:
    arrivals = [w("a"), w("a"), w("b"), w("c", "critical"), w("b")]
    fcfs, prio, rr = FairQueue("fcfs"), FairQueue("priority"), FairQueue("round_robin")
    for q in (fcfs, prio, rr):
        for x in arrivals:
            x.queued = False
            q.push(x)
        order = [q.pop() for _ in arrivals]
        names = [(x.flow if x else None) for x in order]
        if q is fcfs:
            assert names == ["a", "a", "b", "c", "b"]
        elif q is prio:
            assert names == ["c", "a", "a", "b", "b"]
        else:
            assert names == ["c", "a", "b", "a", "b"]


def test_a_full_queue_sheds_the_worst_request_flex_first() -> None:
    q = FairQueue("fair", max_queued=5)
    keep = [q.push(x) for x in (w("hog"), w("hog", deadline=1), w("hog", deadline=0.5),
                                w("light"), w("x", "flex"))]
    assert keep == [None] * 5
    q.charge("light", 1e6, 0)  # even the most-served flow keeps its place against a hog
    newcomer = w("light", deadline=1)
    shed = q.push(newcomer)
    assert shed is not None and shed.band == "flex" and not shed.queued
    shed = q.push(w("light", deadline=2))  # no flex left: the longest queue loses, hog's
    assert shed is not None and shed.flow == "hog" and shed.deadline == 1
    flex = w("y", "flex")
    assert q.push(flex) is flex and not flex.queued  # the newcomer itself is the worst
    q.remove(newcomer)
    assert q.size == 4 and q.remove(newcomer) is None and q.size == 4


@pytest.mark.parametrize("seed", range(5))
def test_backlogged_flows_stay_within_vtcs_bound(seed: int) -> None:
    """Two flows backlogged throughout, random request sizes, one request running at a time
    (a batch holds at most one request's tokens, M = L_in + L_out): the weighted service
    each received never differs by more than VTC's 2·max(w_in·L_in, w_out·M)."""
    rng = random.Random(seed)
    q = FairQueue("fair", w_in=1, w_out=2)
    served = {"a": 0.0, "b": 0.0}
    max_in, max_out = 4000, 500
    for flow in ("a", "b"):
        for _ in range(5):
            q.push(w(flow, cin=rng.randint(1, max_in), cout=rng.randint(1, max_out)))
    worst = 0.0
    for _ in range(2000):
        x = q.pop()
        assert x is not None
        q.charge(x.flow, x.cost_in, x.cost_out)
        served[x.flow] += x.cost_in + 2 * x.cost_out
        worst = max(worst, abs(served["a"] - served["b"]))
        # "a" sends requests ten times bigger on average; both stay backlogged
        big = 10 if x.flow == "a" else 1
        q.push(w(x.flow, cin=rng.randint(1, max_in // big * big) if big == 1 else
                 rng.randint(max_in // 2, max_in), cout=rng.randint(1, max_out)))
    assert worst <= q.bound(max_in, max_in + max_out)


def _pool(n: int) -> list[EndpointState]:
    return [EndpointState(f"http://127.0.0.1:{9000 + i}/v1") for i in range(n)]


def test_the_gate_holds_only_when_every_endpoint_is_saturated() -> None:
    eps = _pool(2)
    gate = Gate(FlowControl(mode="fair", queue_depth=1), lambda: eps)
    a = gate.offer(w("a"), 0.0)
    b = gate.offer(w("a"), 0.0)
    assert a.go and b.go and gate.free(0.0) == 0  # two slots, both granted (not yet sent)
    held = w("a")
    assert not gate.offer(held, 0.0).go  # no other flow waits: no headroom
    # a flow served less than a waiting one is the queue's head and may use the headroom:
    # one more request per endpoint
    c, d = gate.offer(w("b"), 0.0), gate.offer(w("c"), 0.0)
    assert c.go and d.go and gate.headroom(0.0) == 0
    assert not gate.offer(held, 0.0).go and held.queued
    pool = EndpointPool(Model("m", ()), eps)
    tickets = [pool.acquire(e, 10, 10) for e in eps for _ in range(2)]
    for _ in range(4):
        gate.sent()
    assert gate.pump(0.0) == []  # sent: each endpoint has two requests not started
    EndpointPool.first_token(tickets[0])
    EndpointPool.first_token(tickets[1])
    assert gate.pump(0.0) == [held]  # work-conserving: room, so it goes
    gate.sent()
    eps[1].engine.kv_usage = 0.95
    EndpointPool.first_token(tickets[2])
    EndpointPool.first_token(tickets[3])
    # (held went elsewhere) eps[0] has room for one, two with the headroom; KV-full eps[1]
    # has none either way
    assert gate.free(0.0) == 1 and gate.headroom(0.0) == 2


def test_the_gate_counts_the_endpoints_routing_would_try() -> None:
    """Healthy endpoints not draining; when none is healthy, every one not draining (routing
    tries them rather than refusing: the gate must not hold what routing would send)."""
    eps = _pool(3)
    gate = Gate(FlowControl(mode="fair", queue_depth=1), lambda: eps)
    eps[2].health.draining = True
    assert gate.free(0.0) == 2
    eps[0].health.down_until = 10.0
    assert gate.free(0.0) == 1  # only the healthy one
    eps[1].health.down_until = 10.0
    assert gate.free(0.0) == 2  # none healthy: both not draining, as routing would try them
    assert gate.free(10.0) == 2  # back up
    eps[0].health.draining = eps[1].health.draining = True
    assert gate.free(0.0) == 0 and not gate.offer(w("a"), 0.0).go


def test_a_light_flow_uses_the_headroom_a_busy_one_waits() -> None:
    eps = _pool(1)
    gate = Gate(FlowControl(mode="fair", queue_depth=1), lambda: eps)
    assert gate.offer(w("busy"), 0.0).go
    waiting = w("busy")
    assert not gate.offer(waiting, 0.0).go  # over the depth, and no one else waits
    gate.queue.charge("busy", 10_000, 0)  # it was served a lot meanwhile
    light = w("light")
    assert gate.offer(light, 0.0).go and waiting.queued  # light goes ahead, at once


def test_a_light_tenants_burst_uses_the_headroom_behind_a_flood() -> None:
    """A flood of many queued requests; a light tenant's burst of three arrives: though its
    counter passes the flood's after the first (VTC gives no credit), each goes through the
    headroom, not behind the flood's queue; one request the flood sends meanwhile does not."""
    eps = _pool(2)
    gate = Gate(FlowControl(mode="fair", queue_depth=1), lambda: eps)
    pool = EndpointPool(Model("m", ()), eps)
    for _ in range(2):
        assert gate.offer(w("flood"), 0.0).go
    for e in eps:
        pool.acquire(e, 10, 10)
        gate.sent()
    for _ in range(20):
        assert not gate.offer(w("flood"), 0.0).go
    burst = [w("light", cin=500) for _ in range(3)]
    went = [gate.offer(x, 0.0).go for x in burst[:2]]
    assert went == [True, True] and gate.headroom(0.0) == 0  # one per endpoint
    assert not gate.offer(burst[2], 0.0).go  # no headroom left: it waits (near the head)
    assert gate.queue.counters["light"] > gate.queue.counters["flood"]
    e0 = pool.acquire(eps[0], 10, 10)
    gate.sent()
    gate.sent()
    EndpointPool.first_token(e0)  # room for one more beyond saturation again
    assert gate.pump(0.0) == [burst[2]]  # the light one, not the flood's head


def test_two_floods_take_the_headroom_in_fair_order_only() -> None:
    """Between two flooders the shorter queue is not 'light': it may use the headroom only
    as the fair queue's head, so it cannot run ahead of the other."""
    eps = _pool(1)
    gate = Gate(FlowControl(mode="fair", queue_depth=1), lambda: eps)
    assert gate.offer(w("a"), 0.0).go
    gate.sent()
    for _ in range(30):
        gate.offer(w("a"), 0.0)
    for _ in range(10):
        gate.offer(w("d"), 0.0)
    gate.queue.charge("d", 100_000, 0)  # d is far ahead in service
    x = w("d")
    assert not gate.offer(x, 0.0).go and x.queued  # shorter queue, but served well ahead
    assert all(y.flow == "a" for y in gate.pump(0.0))


def test_fcfs_never_holds() -> None:
    eps = _pool(1)
    gate = Gate(FlowControl(mode="fair", queue_depth=1), lambda: eps, mode="fcfs")
    assert all(gate.offer(w("a"), 0.0).go for _ in range(10)) and gate.queue.size == 0


def test_the_command_line_mode_overrides_the_policys() -> None:
    from gateway.flow.control import FlowGates
    from gateway.front.process import ServeConfig, make_state
    from gateway.metrics import GatewayMetrics

    assert not FlowGates(GatewayMetrics()).queues(FlowControl())  # the policy's fcfs
    gates = FlowGates(GatewayMetrics(), "fair")
    assert gates.queues(FlowControl())
    assert gates.get("m", FlowControl(), lambda: ()).gate.mode == "fair"
    assert not FlowGates(GatewayMetrics(), "fcfs").queues(FlowControl(mode="fair"))
    policy = str(Path(__file__).resolve().parent.parent / "gateway" / "policies" / "demo.yaml")
    state, _ = make_state(ServeConfig(policy, flow_mode="round_robin"))  # serve --flow-control
    assert state.flow.mode == "round_robin"


def test_idle_flows_below_the_floor_are_forgotten() -> None:
    """Flow ids may come from clients (x-fairness-id): the counters of idle flows a return
    would lift anyway are dropped, so they stay as many as the flows served above the rest."""
    q = FairQueue("fair")
    q.push(w("steady"))
    for i in range(5000):  # one-off sessions, each served once while steady waits
        x = w(f"s{i}")
        q.push(x)
        q.remove(x)
        q.charge("steady", 10, 0)  # steady keeps being served: the floor rises
    assert len(q.counters) < 300 and "steady" in q.counters


def test_the_admin_view_lists_the_most_served_flows_of_a_tenant_or_all() -> None:
    from gateway.flow import view
    from gateway.flow.control import FlowGates
    from gateway.metrics import GatewayMetrics

    gates = FlowGates(GatewayMetrics(), "fair")
    q = gates.get("m", FlowControl(), lambda: ()).gate.queue
    for i in range(60):
        q.counters[f"acme/s{i}"] = float(i)
    q.counters["acme"] = 100.0
    q.counters["acmex"] = 1000.0  # another tenant, whose name starts with acme

    def flows(**kw: Any) -> list[str]:
        m = view.snapshot(gates, None, **kw)["models"]["m"]
        return [f["flow"] for f in m["flows"]]

    assert flows()[:3] == ["acmex", "acme", "acme/s59"] and len(flows()) == view.LIMIT
    assert view.snapshot(gates, None)["models"]["m"]["flows_total"] == 62
    assert flows(of="acme", limit=5) == ["acme", "acme/s59", "acme/s58", "acme/s57", "acme/s56"]
    assert len(flows(of="acme", limit=1000)) == 61
    assert flows(of="acme/s3") == ["acme/s3"] and flows(of="nobody") == []


def test_isolation_holds_a_heavier_tenant_to_a_smaller_batch_while_a_lighter_one_runs() -> None:
    """``isolation_step_ms``: the endpoint decodes at 30 ms a step, under the 40 ms
    threshold; while the light tenant has a request running, the heavier tenant (served more)
    is let through only below 25 ms, so it waits; once the light one has settled, it goes.
    Without the setting it goes at once."""
    def gate(isolation: float | None) -> tuple[Gate, list[EndpointState]]:
        eps = _pool(1)
        eps[0].live.step_ms, eps[0].live.step_mark = 30.0, (0.0, 0, 0.0)
        return Gate(FlowControl(mode="fair", queue_depth=4, tpot_threshold_ms=40.0,
                                isolation_step_ms=isolation), lambda: eps), eps

    g, _ = gate(25.0)
    light = w("light")
    assert g.offer(light, 0.0).go
    g.sent()
    g.queue.charge("heavy", 10_000, 0)  # served far more than light
    heavy = w("heavy")
    assert not g.offer(heavy, 0.0).go and heavy.queued
    assert g.pump(0.0) == []
    g.settled(light, 100, 10)
    assert g.pump(0.0) == [heavy]
    plain, _ = gate(None)
    assert plain.offer(w("light"), 0.0).go
    plain.sent()
    plain.queue.charge("heavy", 10_000, 0)
    assert plain.offer(w("heavy"), 0.0).go


def test_the_request_shed_when_the_queue_is_full_is_the_worst_by_the_shed_order() -> None:
    """``_worst`` (tenants compared first, then the worst tenants' latest deadlines) picks the
    very waiter a scan of every waiter by ``_shed_key`` picks, through pushes, removals,
    charges, sub-flows, bands and tenants tied on queue length and service."""
    rng = random.Random(7)
    q = FairQueue("fair", max_queued=10_000)
    live: list[Waiter] = []
    for step in range(3000):
        r = rng.random()
        if r < 0.6 or not live:
            tenant = rng.choice(["a", "b", "c", "d"])
            flow = tenant if rng.random() < 0.5 else f"{tenant}/s{rng.randrange(5)}"
            x = w(flow, rng.choice(["critical", "standard", "standard", "flex"]),
                  deadline=float(rng.randrange(50)))
            q.push(x)
            live.append(x)
        elif r < 0.85:
            x = live.pop(rng.randrange(len(live)))
            q.remove(x)
        else:
            q.charge(rng.choice(["a", "b", "c", "d"]), rng.choice([0, 100]), 0)
        queued = [x for x in live if x.queued]
        want = max(queued, key=q._shed_key) if queued else None
        assert q._worst() is want, step
