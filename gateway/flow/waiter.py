"""What waits in a flow-control queue (``Waiter``), in which band, for which tenant, and the
``priority`` an engine's own queue gets for it."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

BANDS = ("critical", "reserved", "standard", "flex")
_seq = itertools.count()


def tenant_of(flow: str) -> str:
    """The tenant a flow (``tenant`` or ``tenant/ID``) belongs to."""
    return flow.partition("/")[0]


def engine_priority(band: str, backlogged: bool) -> int:
    """The ``priority`` an engine running vLLM's priority policy gets (lower first): by band,
    and within a band a request whose tenant still has others waiting in the gateway (a
    tenant using more than its share) behind the requests of tenants that have none. With
    nothing waiting it is the band's alone, so the engine's order within a band stays
    arrival."""
    return 2 * BANDS.index(band) + (1 if backlogged else 0)


@dataclass(slots=True, eq=False)
class Waiter:
    """One waiting request. ``cost_in``/``cost_out``: its prompt and reserved output tokens;
    ``payload``: whatever the caller needs to wake it (a future)."""

    flow: str
    band: str
    deadline: float
    cost_in: float
    cost_out: float
    weight: float = 1.0
    payload: Any = None
    seq: int = field(default_factory=lambda: next(_seq))
    queued: bool = False
    tenant: str = ""  # set when queued: ``tenant_of(flow)``
    sub: str = ""  # set when queued: its sub-flow (``flow``, or ``OVERFLOW``)

    def key(self) -> tuple[float, int]:
        return (self.deadline, self.seq)
