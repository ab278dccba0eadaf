"""Many models on a shared pool: which instances host which model, and which instance serves a
request. Pure functions, shared by the gateway and the simulator.

**Placement** follows token velocity (tokens/s each model is asked for). An instance hosts at
most ``per_instance`` models (what its host memory holds ready to switch in; 1 is a dedicated
fleet). Every model gets one instance; the remaining hosting slots go, one at a time, to the
model with the most velocity per replica (the D'Hondt rule), so hosting follows demand and a
cold model keeps one warm home where it wakes in a switch, not a cold start. Replicas are then
laid out heaviest first, each on the instance carrying the least velocity that does not
host that model yet.

**Routing** by residency: among the instances hosting the model, the one with the earliest
predicted start — what the instance says the model waits for the GPU (its switch, 0 when the
weights are resident; with request-level pooling, another model's batch draining) plus the
work queued ahead of it, in modelled seconds.
"""

from __future__ import annotations

import contextlib
import heapq
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

_WAIT = re.compile(r'^tokengate_backend_model_(wait_seconds|resident)\{([^}]*)\}\s+(\S+)')
_LABEL = re.compile(r'(\w+)="([^"]*)"')


def placement(velocity: Mapping[str, float], instances: int, per_instance: int
              ) -> list[list[str]]:
    """The models each of ``instances`` hosts. Raises ValueError when they cannot all fit."""
    if instances <= 0 or per_instance <= 0:
        raise ValueError("placement needs at least one instance and one model per instance")
    models = sorted(velocity, key=lambda m: (-velocity[m], m))
    if len(models) > instances * per_instance:
        raise ValueError(f"{len(models)} models do not fit on {instances} instance(s) of "
                         f"{per_instance} model(s) each")
    replicas = dict.fromkeys(models, 1)
    spare = min(instances * per_instance, len(models) * instances) - len(models)
    heap = [(-max(velocity[m], 0.0) / 2, m) for m in models if instances > 1]
    heapq.heapify(heap)
    while spare > 0 and heap:
        _, m = heapq.heappop(heap)
        replicas[m] += 1
        spare -= 1
        if replicas[m] < instances:
            heapq.heappush(heap, (-max(velocity[m], 0.0) / (replicas[m] + 1), m))
    hosts: list[list[str]] = [[] for _ in range(instances)]
    load = [0.0] * instances
    for m in models:
        share = max(velocity[m], 0.0) / replicas[m]
        order = sorted(range(instances), key=lambda i: (len(hosts[i]) >= per_instance,
                                                       load[i], len(hosts[i]), i))
        for i in order[:replicas[m]]:
            if len(hosts[i]) >= per_instance:
                raise ValueError("placement ran out of hosting slots")  # cannot happen
            hosts[i].append(m)
            load[i] += share
    return hosts


@dataclass(frozen=True, slots=True)
class InstanceView:
    """What routing knows of a pool instance (from its metrics, or the simulator's state)."""

    name: str
    hosts: frozenset[str]
    resident: frozenset[str]
    wait_s: Mapping[str, float]  # before the model could run: its switch (0: resident), ...
    queued_s: float  # modelled seconds of work queued ahead of a new request


def pick(model: str, instances: Sequence[InstanceView]) -> InstanceView | None:
    """The instance hosting ``model`` where it would start soonest (None: nobody hosts it)."""
    best: InstanceView | None = None
    best_s = 0.0
    for inst in instances:
        if model not in inst.hosts:
            continue
        start = inst.queued_s + inst.wait_s.get(model, 0.0)
        if best is None or start < best_s:
            best, best_s = inst, start
    return best


def read_residency(text: str) -> tuple[dict[str, float], frozenset[str]]:
    """From an engine's ``/metrics``: what each hosted model waits before it could run (the
    reference backend's ``tokengate_backend_model_wait_seconds``) and which are resident.
    Empty for an engine that hosts one model the classic way (vLLM)."""
    wait: dict[str, float] = {}
    resident: set[str] = set()
    for line in text.splitlines():
        if not line.startswith("tokengate_backend_model_"):
            continue
        m = _WAIT.match(line)
        if m is None:
            continue
        name = dict(_LABEL.findall(m.group(2))).get("model_name")
        if name is None:
            continue
        with contextlib.suppress(ValueError):
            value = float(m.group(3))
            if m.group(1) == "wait_seconds":
                wait[name] = value
            elif value >= 1.0:
                resident.add(name)
    return wait, frozenset(resident)
