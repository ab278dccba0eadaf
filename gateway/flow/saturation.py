"""When is a pool saturated: a pure reading of what the gateway knows of its endpoints.

An endpoint has room while the requests waiting to start on it are fewer than ``queue_depth``
(the larger of the gateway's own live count of requests it sent there without a first token,
exact at every decision, with the other replicas' counts as of their last exchange added, and
the engine's scraped queue), its KV cache (scraped) is below ``kv_threshold`` and, when
``step_ms`` is set, the time between tokens its streams lately saw (the gateway's measure) is
below it: a batch already at the TPOT target takes no one more. The pool has as many
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
    step_ms: float | None = None  # a decode step this slow (per sequence) leaves no room
    # count the other replicas' requests awaiting their first token (one exchange old): the
    # headroom for a tenant within its share does not, so that a count another replica has
    # not renewed yet never holds the light tenant back
    elsewhere: bool = True


def room(ep: EndpointState, t: Thresholds, now: float) -> int:
    """How many more requests ``ep`` can take before it counts as saturated."""
    if ep.engine.kv_usage >= t.kv_threshold:
        return 0
    if t.step_ms is not None and ep.live.current_step_ms(now) >= t.step_ms:
        return 0
    # its own count is exact, the other replicas' one exchange old; the engine's is scraped
    sent = len(ep.live.pending) + (ep.live.pending_elsewhere if t.elsewhere else 0)
    return max(0, t.queue_depth - max(sent, int(ep.engine.waiting)))


def free_slots(endpoints: Iterable[EndpointState], t: Thresholds, let_through: int,
               now: float) -> int:
    """Requests the pool can take now: its endpoints' room, less ``let_through`` (granted a
    turn, not yet sent). The endpoints counted are those routing would try: the healthy ones
    not draining or, when none is healthy, every one not draining (routing tries them rather
    than refusing, so the gate does not hold requests that routing would send)."""
    live = [e for e in endpoints if not e.health.draining]
    healthy = [e for e in live if e.healthy(now)]
    return sum(room(e, t, now) for e in healthy or live) - let_through
