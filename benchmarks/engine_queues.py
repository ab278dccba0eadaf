"""What a request found in the engines when it reached one, from the reference backends'
``/admin/requests`` (every finished request's arrival, first scheduling and finish on the
host's monotonic clock, and which backend served it): how many requests were waiting ahead of
it in its engine's first-come queue, how many waited in the least-queued other engine (had it
been routed there), and how many requests every engine held in all (waiting or running).

It tells the two ways a request can wait longer in an engine's queue apart: more requests let
into the engines in all (admission), or as many but on the engine it was sent to (routing).
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(slots=True)
class _Engine:
    arrivals: list[float]  # sorted
    scheduled: list[float]  # sorted (a request never scheduled counts as leaving at finish)
    finished: list[float]  # sorted

    def waiting(self, t: float) -> int:
        """Requests arrived before ``t`` and not yet scheduled at ``t``."""
        return bisect_left(self.arrivals, t) - bisect_right(self.scheduled, t)

    def holding(self, t: float) -> int:
        """Requests arrived before ``t`` and not finished at ``t`` (waiting or running)."""
        return bisect_left(self.arrivals, t) - bisect_right(self.finished, t)


def _engines(engine: Mapping[str, Mapping[str, Any]], only: set[str] | None = None
             ) -> dict[Any, _Engine]:
    by: dict[Any, list[Mapping[str, Any]]] = {}
    for rid, e in engine.items():
        if only is None or rid in only:
            by.setdefault(e.get("port"), []).append(e)
    out = {}
    for port, rows in by.items():
        done = [float(r["finished"]) for r in rows]
        sched = [float(r["scheduled"]) if r["scheduled"] is not None else float(r["finished"])
                 for r in rows]
        out[port] = _Engine(sorted(float(r["arrival"]) for r in rows), sorted(sched),
                            sorted(done))
    return out


def victim_view(rids: Iterable[str], engine: Mapping[str, Mapping[str, Any]]
                ) -> dict[str, Any]:
    """For the requests ``rids``, at each one's arrival at its engine: ``ahead`` (waiting
    ahead of it there), ``ahead_elsewhere`` (waiting in the least-queued other engine),
    ``held`` (requests held by all engines, waiting or running), ``ahead_own`` (those of
    ``rids`` among ``ahead``: the victim's own requests), each as p50 / p90 / mean;
    ``shorter_elsewhere``: the share of them that another engine had fewer waiting for."""
    rids = list(rids)
    engines, own = _engines(engine), _engines(engine, set(rids))
    rows = []
    for rid in rids:
        e = engine.get(rid)
        if e is None:
            continue
        t, port = float(e["arrival"]), e.get("port")
        mine = engines[port].waiting(t)
        others = [g.waiting(t) for p, g in engines.items() if p != port]
        rows.append((mine, min(others) if others else mine,
                     sum(g.holding(t) for g in engines.values()), own[port].waiting(t)))
    if not rows:
        return {"requests": 0}
    a = np.array(rows, dtype=float)
    out: dict[str, Any] = {"requests": len(rows)}
    for k, name in enumerate(("ahead", "ahead_elsewhere", "held", "ahead_own")):
        out[name] = [float(np.percentile(a[:, k], 50)), float(np.percentile(a[:, k], 90)),
                     float(a[:, k].mean())]
    out["shorter_elsewhere"] = float((a[:, 1] < a[:, 0]).mean())
    return out
