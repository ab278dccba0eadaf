"""What ``/admin/flow`` shows: per model, the mode, what waits (per band and per flow), the
slots free now, each flow's fair-share counter (the most served first, at most ``limit``; only
``of``'s flows when given: a tenant's, or one flow), and whether the counters are shared through
Redis right now. A tenant's ``served`` is its weighted service (shared by replicas); a
sub-flow's (``tenant/ID``) is its service within its tenant, on this replica."""

from __future__ import annotations

import time
from typing import Any

from gateway.flow.control import FlowGates
from gateway.flow.share import CounterShare
from gateway.flow.waiter import tenant_of

LIMIT = 50


def belongs(flow: str, of: str) -> bool:
    """``flow`` is ``of`` or one of its sub-flows (a tenant's ``tenant/x-fairness-id``)."""
    return flow == of or flow.startswith(of + "/")


def snapshot(gates: FlowGates, share: CounterShare | None, limit: int = LIMIT,
             of: str | None = None) -> dict[str, Any]:
    now = time.monotonic()
    models: dict[str, Any] = {}
    for name, mg in sorted(gates.gates.items()):
        g = mg.gate
        q = g.queue
        waiting = q.waiting_by_flow()
        for f, n in list(waiting.items()):  # a tenant's entry counts all its sub-flows'
            if "/" in f:
                waiting[tenant_of(f)] = waiting.get(tenant_of(f), 0) + n
        served = {**q.sub_counters(), **q.counters}
        flows = {f for f in set(served) | set(waiting) if of is None or belongs(f, of)}
        top = sorted(flows, key=lambda f: (-served.get(f, 0.0), f))[:limit]
        models[name] = {
            "mode": g.mode, "waiting": dict(q.waiting()), "queued": q.size,
            "granted_not_sent": g.let_through,
            "free_slots": g.free(now) if g.queues else None,
            "flows": [{"flow": f, "waiting": waiting.get(f, 0),
                       "served": round(served.get(f, 0.0), 3)} for f in top],
            "flows_total": len(flows)}
    shared = None if share is None else {
        "degraded": share.degraded, "exchanges": share.exchanges, "failures": share.failures,
        "interval_s": share.interval_s}
    return {"mode_override": gates.mode, "shared": shared, "models": models}
