"""What an InferencePool and its pods say, read from the Kubernetes API's JSON: the label
selector and ports of a pool (``inference.networking.k8s.io/v1``), and which pods are ready
endpoints. Pure functions: the watcher (``gateway.discovery.kube``) feeds them."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any


class PoolInvalid(ValueError):
    """The InferencePool has no selector or ports this gateway can follow."""


@dataclass(frozen=True, slots=True)
class PoolTarget:
    selector: str  # a label selector, as the API's ``labelSelector`` parameter takes it
    ports: tuple[int, ...]


def pool_target(pool: Mapping[str, Any], port: int | None = None) -> PoolTarget:
    """The pods an InferencePool selects (``spec.selector.matchLabels``) and the ports they
    serve on (``spec.targetPorts[].number``, or ``port`` when the policy overrides them)."""
    spec = pool.get("spec") or {}
    labels = (spec.get("selector") or {}).get("matchLabels") or {}
    if not isinstance(labels, Mapping) or not labels:
        raise PoolInvalid("the InferencePool has no spec.selector.matchLabels")
    ports = (port,) if port is not None else tuple(
        int(p["number"]) for p in spec.get("targetPorts") or () if isinstance(p, Mapping)
        and isinstance(p.get("number"), int))
    if not ports:
        raise PoolInvalid("the InferencePool has no spec.targetPorts")
    return PoolTarget(",".join(f"{k}={v}" for k, v in sorted(labels.items())), ports)


def ready(pod: Mapping[str, Any]) -> bool:
    """A pod takes requests: running, its Ready condition true, an IP, not being deleted."""
    meta, status = pod.get("metadata") or {}, pod.get("status") or {}
    if meta.get("deletionTimestamp") or not status.get("podIP"):
        return False
    if status.get("phase") != "Running":
        return False
    return any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in status.get("conditions") or () if isinstance(c, Mapping))


ROLES = ("prefill", "decode", "both")


def role(pod: Mapping[str, Any], label: str) -> str:
    """The pod's part in prefill/decode disaggregation, from its ``label`` (llm-d's
    ``llm-d.ai/role``): ``prefill``, ``decode``, else ``both``."""
    value = ((pod.get("metadata") or {}).get("labels") or {}).get(label)
    return value if value in ROLES else "both"


def addresses(pods: Iterable[Mapping[str, Any]], ports: Iterable[int],
              role_label: str = "llm-d.ai/role") -> list[tuple[str, int, str]]:
    """``(ip, port, role)`` of every ready pod on every port, sorted."""
    ps = tuple(ports)
    return sorted({(str(p["status"]["podIP"]), port, role(p, role_label)) for p in pods
                   if ready(p) for port in ps})


def key(obj: Mapping[str, Any]) -> str:
    meta = obj.get("metadata") or {}
    return f"{meta.get('namespace', '')}/{meta.get('name', '')}"


def resource_version(obj: Mapping[str, Any]) -> str | None:
    rv = (obj.get("metadata") or {}).get("resourceVersion")
    return str(rv) if rv else None
