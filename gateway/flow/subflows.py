"""A tenant's sub-flows (``tenant/ID``: ``x-fairness-id``, an agent session) for the fair queue
(``gateway.flow.fair``): which sub-flow a request waits in, the service each got within its
tenant (this replica's: sub-flows divide their tenant's share and are never shared), and how
many requests each has waiting.

A tenant has at most ``max_subflows`` sub-flows waiting at once; requests naming further ids
share one more sub-flow (``OVERFLOW``). A sub-flow becoming backlogged is lifted to the least
counter among its tenant's waiting sub-flows (or to the counter of the one that left last), and
the counters of idle sub-flows are forgotten (a return is lifted to the floor, as if it had
none), so what a tenant's ids cost is bounded whatever the client sends.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_SUBFLOWS = 64  # sub-flows of one tenant waiting at once; further ids share OVERFLOW
OVERFLOW = "~more"  # the sub-flow of a tenant's requests beyond MAX_SUBFLOWS ids


@dataclass(slots=True)
class Subs:
    """One tenant's sub-flow counters (service within the tenant) and waiting requests."""

    counters: dict[str, float] = field(default_factory=dict)
    last_left: float = 0.0
    waiting: dict[str, int] = field(default_factory=dict)  # queued requests per sub-flow


class SubFlows:
    def __init__(self, max_subflows: int = MAX_SUBFLOWS) -> None:
        self.max_subflows = max_subflows
        self.tenants: dict[str, Subs] = {}

    def __getitem__(self, tenant: str) -> Subs:
        return self.tenants[tenant]

    def enter(self, tenant: str, flow: str) -> str:
        """The sub-flow a request of ``flow`` waits in (lifted within its tenant when it
        becomes backlogged), at most ``max_subflows`` of a tenant's at once."""
        subs = self.tenants.get(tenant)
        if subs is None:
            subs = self.tenants[tenant] = Subs()
        sub = flow
        if sub not in subs.waiting and len(subs.waiting) >= self.max_subflows:
            sub = OVERFLOW
        if sub not in subs.waiting:
            if len(subs.counters) >= 4 * self.max_subflows:
                self._forget(subs)
            floor = min((subs.counters.get(s, 0.0) for s in subs.waiting),
                        default=subs.last_left)
            subs.counters[sub] = max(subs.counters.get(sub, 0.0), floor)
        subs.waiting[sub] = subs.waiting.get(sub, 0) + 1
        return sub

    def leave(self, tenant: str, sub: str) -> None:
        """A request of ``sub`` stopped waiting."""
        subs = self.tenants[tenant]
        n = subs.waiting[sub] - 1
        if n:
            subs.waiting[sub] = n
        else:
            del subs.waiting[sub]
            subs.last_left = subs.counters.get(sub, 0.0)

    def charge(self, tenant: str, sub: str, amount: float) -> None:
        """``sub`` (a remembered sub-flow of ``tenant``) was served ``amount``."""
        subs = self.tenants.get(tenant)
        if subs is not None and sub in subs.counters:
            subs.counters[sub] += amount

    def counter(self, tenant: str, sub: str) -> float:
        return self.tenants[tenant].counters.get(sub, 0.0)

    def left_backlog(self, tenant: str) -> None:
        """``tenant`` has nothing waiting any more: nothing to remember when it had one
        sub-flow at most."""
        subs = self.tenants.get(tenant)
        if subs is not None and not subs.waiting and len(subs.counters) <= 1:
            del self.tenants[tenant]

    def inherit(self, old: SubFlows) -> None:
        for t, subs in old.tenants.items():
            self.tenants.setdefault(t, Subs()).counters.update(subs.counters)

    def _forget(self, subs: Subs) -> None:
        """Keep a tenant's sub-flow counters few: drop the idle ones at or below the floor,
        then, still too many, the least served idle ones (a return is lifted to the floor)."""
        floor = min((subs.counters.get(s, 0.0) for s in subs.waiting), default=subs.last_left)
        idle = sorted((c, s) for s, c in subs.counters.items() if s not in subs.waiting)
        extra = len(subs.counters) - 2 * self.max_subflows
        for c, s in idle:
            if c <= floor or extra > 0:
                del subs.counters[s]
                extra -= 1

    def waiting_of(self, tenant: str) -> int:
        """Requests ``tenant`` has waiting (all bands)."""
        subs = self.tenants.get(tenant)
        return sum(subs.waiting.values()) if subs is not None else 0

    def waiting_by_flow(self) -> dict[str, int]:
        """Requests waiting per sub-flow (all bands), named ``tenant`` or ``tenant/ID``
        (``tenant/~more`` for the ids beyond ``max_subflows``)."""
        out: dict[str, int] = {}
        for tenant, subs in self.tenants.items():
            for sub, n in subs.waiting.items():
                name = f"{tenant}/{OVERFLOW}" if sub == OVERFLOW else sub
                out[name] = out.get(name, 0) + n
        return out

    def counters(self) -> dict[str, float]:
        """Each remembered sub-flow's service within its tenant (this replica's)."""
        return {(f"{t}/{OVERFLOW}" if s == OVERFLOW else s): c
                for t, subs in self.tenants.items() for s, c in subs.counters.items() if s != t}
