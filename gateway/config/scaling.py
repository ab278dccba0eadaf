"""A model's ``scaling:`` section: how its pool grows, shrinks and changes roles
(``gateway.scaling``).

```yaml
scaling:
  policy: velocity          # velocity (token velocity, TokenScale) | concurrency (baseline)
  min_replicas: 0           # 0: scale to zero when idle; requests are held while it wakes
  max_replicas: 4
  target_utilization: 0.7   # velocity: keep each stage's demand under this share of capacity
  target_concurrency: 8     # concurrency: requests in flight (or queued) per replica
  idle_timeout_s: 30        # no request for this long: drain and scale to zero (min 0)
  scale_down_delay_s: 10    # fewer replicas needed for this long before one is removed
  max_held: 256             # requests held while the pool has no ready endpoint
  launcher:
    kind: reference         # reference: this model's reference backend (backend: section)
    # kind: command, command: [my-server, --port, "{port}"]   (any server; {port} filled in)
    time_scale: 1.0         # reference backends' time scale
  # Without a launcher the gateway only exports tokengate_desired_replicas; on Kubernetes a
  # KEDA ScaledObject scales the Deployment on it (deploy/k8s/keda-scaledobject.yaml).
  disaggregated: true       # launch prefill and decode instances (a PD pool; the default
                            # follows the static endpoints' roles); at least one of each
  convertible: true         # PD pools: decoders switch to prefill for bursts
  convert_backlog_ratio: 0.5  # convert when predicted prefill backlog > ratio x TTFT SLO
  revert_backlog_ratio: 0.3   # convert back when it stays under this ratio...
  revert_after_s: 5           # ...for this long (hysteresis)
  ttft_slo_ms: 2000
```
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from gateway.config import schema
from gateway.config.decode import Decoder


@dataclass(frozen=True, slots=True)
class Launcher:
    kind: Literal["reference", "command"] = "reference"
    command: tuple[str, ...] = ()  # kind: command; "{port}" is replaced
    time_scale: float = 1.0  # kind: reference


@dataclass(frozen=True, slots=True)
class Scaling:
    policy: Literal["velocity", "concurrency"] = "velocity"
    min_replicas: int = 1
    max_replicas: int = 4
    target_utilization: float = 0.7
    target_concurrency: float = 8.0
    idle_timeout_s: float = 30.0
    scale_down_delay_s: float = 10.0
    max_held: int = 256
    launcher: Launcher | None = None
    disaggregated: bool = False
    convertible: bool = False
    convert_backlog_ratio: float = 0.5
    revert_backlog_ratio: float = 0.3
    revert_after_s: float = 5.0
    ttft_slo_ms: float = 2000.0


def parse_scaling(d: Decoder, raw: Any, path: str) -> Scaling:
    m = d.mapping(raw, path, schema.keys("scaling"))
    kw: dict[str, Any] = {}
    if "policy" in m:
        kw["policy"] = d.choice(m["policy"], f"{path}.policy", {"velocity", "concurrency"})
    if "min_replicas" in m:
        v = m["min_replicas"]
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise d.fail(f"{path}.min_replicas", f"expected an integer >= 0, got {v!r}")
        kw["min_replicas"] = v
    kw.update(d.fields(m, path, ("max_replicas", "max_held"), d.integer))
    kw.update(d.fields(m, path, ("target_utilization", "target_concurrency", "idle_timeout_s",
                                 "scale_down_delay_s", "convert_backlog_ratio",
                                 "revert_backlog_ratio", "revert_after_s", "ttft_slo_ms"),
                       d.number))
    for k in ("convertible", "disaggregated"):
        if k in m:
            if not isinstance(m[k], bool):
                raise d.fail(f"{path}.{k}", "expected true or false")
            kw[k] = m[k]
    if "launcher" in m:
        kw["launcher"] = _launcher(d, m["launcher"], f"{path}.launcher")
    s = Scaling(**kw)
    if s.min_replicas > s.max_replicas:
        raise d.fail(f"{path}.min_replicas", "must not exceed max_replicas")
    if s.disaggregated and s.max_replicas < 2:
        raise d.fail(f"{path}.max_replicas", "a disaggregated pool needs at least 2 (one "
                     "prefill, one decode)")
    if s.target_utilization > 1:
        raise d.fail(f"{path}.target_utilization", "must be within (0, 1]")
    return s


def _launcher(d: Decoder, raw: Any, path: str) -> Launcher:
    m = d.mapping(raw, path, schema.keys("launcher"), schema.required("launcher"))
    kind = d.choice(m["kind"], f"{path}.kind", {"reference", "command"})
    kw: dict[str, Any] = {"kind": kind}
    if kind == "command":
        cmd = d.strings(m.get("command"), f"{path}.command")
        if not any("{port}" in c for c in cmd):
            raise d.fail(f"{path}.command", "must contain {port} where the port goes")
        kw["command"] = cmd
    if "time_scale" in m:
        kw["time_scale"] = d.number(m["time_scale"], f"{path}.time_scale")
    return Launcher(**kw)
