"""Flow control on the simulator's clock (the gateway's gate, driven by the event loop): with a
tenant flooding at ten times the others' rate from Azure conversation arrivals, ``fair`` keeps
the light tenants' TTFT where ``fcfs`` (the engines' own queues) lets the flood bury it, and
the flooder still gets what the others leave (the engines stay as busy)."""

from __future__ import annotations

from gateway.config.flow import FlowControl
from simulator.fairness import Tenant, noisy_neighbour


def test_fair_keeps_a_light_tenant_fast_under_a_flood_and_wastes_no_capacity() -> None:
    tenants = [Tenant("A", 50.0), Tenant("B", 5.0), Tenant("C", 5.0)]
    fcfs = noisy_neighbour(tenants, "fcfs", 30.0)
    fair = noisy_neighbour(tenants, "fair", 30.0, flow=FlowControl(mode="fair"))
    for light in ("B", "C"):
        assert fair["tenants"][light]["ttft_p90_ms"] < 0.2 * fcfs["tenants"][light][
            "ttft_p90_ms"], (fair["tenants"][light], fcfs["tenants"][light])
    assert fair["utilisation"] >= 0.97 * fcfs["utilisation"]
    assert fair["tenants"]["A"]["tokens_per_s"] > 4 * fair["tenants"]["B"]["tokens_per_s"]
    counters = fair["counters"]
    assert counters["A"] > counters["B"] > 0 and counters["A"] > counters["C"] > 0


def test_a_flooder_rotating_its_fairness_id_gains_nothing_over_one_that_does_not() -> None:
    """The same flood, once as one flow and once with a new ``x-fairness-id`` on every
    request: ids divide a tenant's share, never add to it, so the light tenant waits no
    longer (within 10 %; the ids reorder the flooder's own requests, which moves the light
    tenant's figures a little either way) and the flooder is served no more."""
    flow = FlowControl(mode="fair", queue_depth=1, tpot_threshold_ms=40.0)
    plain = noisy_neighbour([Tenant("A", 50.0), Tenant("B", 5.0)], "fair", 30.0, flow=flow)
    rotating = noisy_neighbour([Tenant("A", 50.0, rotate_ids=True), Tenant("B", 5.0)], "fair",
                               30.0, flow=flow)
    for q in ("ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms"):
        a, b = plain["tenants"]["B"][q], rotating["tenants"]["B"][q]
        assert b < 1.10 * a, (q, a, b)
    assert rotating["tenants"]["A"]["requests"] == plain["tenants"]["A"]["requests"]
    assert rotating["tenants"]["A"]["tokens_per_s"] <= 1.02 * plain["tenants"]["A"][
        "tokens_per_s"]
    assert set(rotating["counters"]) == {"A", "B"}  # one counter per tenant, whatever the ids
