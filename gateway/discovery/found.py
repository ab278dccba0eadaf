"""The endpoints discovery found, put into a policy version's pools beside the endpoints the
policy lists (as the autoscaler puts its launched instances): one ``EndpointState`` per URL,
kept in the fleet, so a pod that stays keeps its live counters, scrapes and caches across
changes and policy reloads."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

from gateway.config.policy import Policy
from gateway.routing.endpoints import EndpointPool
from gateway.routing.fleet import Fleet

Found = Mapping[str, Sequence[tuple[str, str]]]  # model -> (url, role)


def attach(policy: Policy, pools: Mapping[str, EndpointPool], fleet: Fleet,
           found: Found) -> None:
    """Each discovering model's pool: the policy's endpoints, then those found (with the
    role their pods' label gives: prefill, decode, or both)."""
    for name, m in policy.models.items():
        d, pool = m.discovery, pools.get(name)
        if d is None or pool is None:
            continue
        listed = {e.url for e in m.endpoints}
        key = os.environ.get(d.api_key_env) if d.api_key_env else None
        static = [e for e in pool.endpoints if e.url in listed]
        extra = [fleet.endpoint(u, key, role, m.backend.hardware)
                 for u, role in found.get(name, ()) if u not in listed]
        # the keys of pods that left go with them (pod IPs come and go for ever)
        pool.api_keys = {u: k for u, k in pool.api_keys.items() if u in listed} | {
            e.url: key for e in extra}
        pool.endpoints = static + extra


def urls(found: Found) -> list[str]:
    return [u for us in found.values() for u, _ in us]
