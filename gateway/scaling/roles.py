"""Which role a launcher pool's instances play, which role the next launch takes, and which
instance scale-in removes (``gateway.scaling.autoscaler`` steers; this decides): pure functions
of the pool's instances and the fleet's endpoint state."""

from __future__ import annotations

from collections.abc import Mapping

from gateway.config.policy import Model
from gateway.routing.endpoints import EndpointState
from gateway.scaling.launcher import Instance


def role_of(inst: Instance, endpoints: Mapping[str, EndpointState]) -> str:
    """An instance's role now, as its endpoint has it (a converted decoder's is ``both``),
    else the role it was launched with."""
    e = endpoints.get(inst.url)
    return e.role if e is not None else inst.role


def in_flight(endpoints: Mapping[str, EndpointState], url: str) -> int:
    e = endpoints.get(url)
    return e.live.in_flight if e is not None else 0


def count_roles(model: Model, endpoints: Mapping[str, EndpointState],
                live: list[Instance]) -> dict[str, int]:
    """Prefill and decode instances of the pool (the policy's own endpoints included)."""
    have = {"prefill": 0, "decode": 0}
    for e in model.endpoints:
        if e.role in have:
            have[e.role] += 1
    for i in live:
        r = role_of(i, endpoints)
        r = "decode" if r == "both" else r  # a converted decoder still decodes
        if r in have:
            have[r] += 1
    return have


def role_to_add(model: Model, endpoints: Mapping[str, EndpointState],
                instances: list[Instance], desired: Mapping[str, int], *,
                disaggregated: bool) -> str:
    """The role of the next launch: a missing role first, then the larger deficit.
    Instances still starting count, so one tick's launches are split between roles."""
    if not disaggregated:
        return "both"
    have = count_roles(model, endpoints, [i for i in instances if i.draining_since is None])
    for r in ("prefill", "decode"):
        if have[r] == 0:
            return r
    return "prefill" if desired.get("prefill", 0) - have["prefill"] >= \
        desired.get("decode", 0) - have["decode"] else "decode"


def victim(model: Model, endpoints: Mapping[str, EndpointState], live: list[Instance],
           desired: Mapping[str, int], target: int, *, disaggregated: bool) -> Instance:
    """The instance to remove: one not yet ready first, then the least busy; in a
    disaggregated pool, from the role with the largest surplus, never a role's last
    instance unless the pool goes to zero."""
    def cost(i: Instance) -> tuple[bool, int]:
        return i.ready_at is not None, in_flight(endpoints, i.url)

    if not disaggregated or target == 0:
        return min(live, key=cost)
    have = count_roles(model, endpoints, live)
    surplus = {r: have[r] - max(desired.get(r, 0), 1) for r in have}
    pool = [i for i in live if have.get(role_of(i, endpoints), 0) > 1] or live
    return min(pool, key=lambda i: (-surplus.get(role_of(i, endpoints), 0), *cost(i)))
