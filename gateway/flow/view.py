"""What ``/admin/flow`` shows: per model, the mode, what waits (per band and per flow), the
slots free now, each flow's fair-share counter (the most served first, at most ``limit``), and
whether the counters are shared through Redis right now."""

from __future__ import annotations

import time
from typing import Any

from gateway.flow.control import FlowGates
from gateway.flow.share import CounterShare


def snapshot(gates: FlowGates, share: CounterShare | None, limit: int = 50) -> dict[str, Any]:
    now = time.monotonic()
    models: dict[str, Any] = {}
    for name, mg in sorted(gates.gates.items()):
        g = mg.gate
        q = g.queue
        waiting = q.waiting_by_flow()
        flows = set(q.counters) | set(waiting)
        top = sorted(flows, key=lambda f: (-q.counters.get(f, 0.0), f))[:limit]
        models[name] = {
            "mode": g.mode, "waiting": dict(q.waiting()), "queued": q.size,
            "granted_not_sent": g.let_through,
            "free_slots": g.free(now) if g.queues else None,
            "flows": [{"flow": f, "waiting": waiting.get(f, 0),
                       "served": round(q.counters.get(f, 0.0), 3)} for f in top],
            "flows_total": len(flows)}
    shared = None if share is None else {
        "degraded": share.degraded, "exchanges": share.exchanges, "failures": share.failures,
        "interval_s": share.interval_s}
    return {"mode_override": gates.mode, "shared": shared, "models": models}
