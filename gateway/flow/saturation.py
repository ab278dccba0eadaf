"""When is a pool saturated: a pure reading of what the gateway knows of its endpoints.

An endpoint has room while the requests the gateway sent it that have not had their first
token (its own live count, exact at every decision, not the scraped queue) are fewer than
``queue_depth``, and its KV cache (scraped) is below ``kv_threshold``. The pool has as many
free slots as its endpoints in rotation have room for, less the requests already let through
and not sent yet. Zero free slots is saturation: requests then wait in the gateway's queues,
where their order is decided (``fair``), instead of in the engines' first-come queues. The
defaults are llm-d's saturation detector's thresholds (queue depth 5, KV 0.8).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from gateway.routing.endpoints import EndpointState


@dataclass(frozen=True, slots=True)
class Thresholds:
    queue_depth: int = 5
    kv_threshold: float = 0.8


def room(ep: EndpointState, t: Thresholds) -> int:
    """How many more requests ``ep`` can take before it counts as saturated."""
    if ep.engine.kv_usage >= t.kv_threshold:
        return 0
    return max(0, t.queue_depth - len(ep.live.pending))


def free_slots(endpoints: Iterable[EndpointState], t: Thresholds, let_through: int,
               now: float) -> int:
    """Requests the pool can take now: its endpoints' room, less ``let_through`` (granted a
    turn, not yet sent)."""
    return sum(room(e, t) for e in endpoints if e.healthy(now)) - let_through
