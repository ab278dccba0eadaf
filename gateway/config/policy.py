"""Policy files: models, tenants and their keys, routes, and limits on every scope.

Loading happens in stages, each error naming the file, the path inside it and the reason:
strict decoding (unknown keys and wrong types are errors), defaults, then cross-reference checks
(fallback chains name known models and have no cycles, routes name known tenants and models,
key digests are well-formed and unique). The result is an immutable ``Policy`` with the lookups
the hot path needs precomputed.

Scopes a request touches: ``tenant:<t>``, ``tenant:<t>|model:<m>``, ``model:<m>``,
``route:<r>``; each may carry ``rpm``, ``tpm`` (with ``burst``, default = tpm), ``tpd`` and a
dollar ``budget`` per day.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import yaml

from gateway.config import schema
from gateway.config.decode import Decoder
from gateway.config.decode import PolicyError as PolicyError  # part of this module's API
from gateway.config.model import Images as Images  # part of this module's API
from gateway.config.model import Limits as Limits  # part of this module's API
from gateway.config.model import Model as Model  # part of this module's API
from gateway.config.model import Price as Price  # part of this module's API
from gateway.config.model import parse_limits, parse_model
from gateway.config.resilience import Timeouts, partial_timeouts
from gateway.config.settings import Settings as Settings  # part of this module's API
from gateway.config.settings import parse_settings

_HEX64 = re.compile(r"^[0-9a-f]{64}$")


@dataclass(frozen=True, slots=True)
class Key:
    name: str
    sha256: str


PRIORITY_RANK = {"flex": 0, "standard": 1, "critical": 2}


@dataclass(frozen=True, slots=True)
class Tenant:
    name: str
    keys: tuple[Key, ...]
    limits: Limits = field(default_factory=Limits)
    model_limits: Mapping[str, Limits] = field(default_factory=dict)
    # The band its requests get by default, and the highest they may ask for (x-priority, an
    # InferenceObjective) unless ``max_priority`` grants a higher one explicitly.
    priority: Literal["critical", "standard", "flex"] = "standard"
    max_priority: Literal["critical", "standard", "flex"] | None = None
    weight: float = 1.0  # its share of a saturated pool under fair flow control
    # provisioned throughput: model -> tokens per minute guaranteed to it on that model's pool
    reserved: Mapping[str, float] = field(default_factory=dict)
    # ... or model -> the share (0-1] of that pool's capacity (``Model.capacity_tpm`` x the
    # endpoints healthy now)
    reserved_share: Mapping[str, float] = field(default_factory=dict)

    def reserved_tpm(self, model: Model, endpoints: int) -> float:
        """Its reserved tokens per minute on ``model``'s pool with ``endpoints`` healthy."""
        share = self.reserved_share.get(model.name)
        if share is not None and model.capacity_tpm:
            return share * model.capacity_tpm * endpoints
        return self.reserved.get(model.name, 0.0)

    @property
    def priority_ceiling(self) -> str:
        return self.max_priority or self.priority


@dataclass(frozen=True, slots=True)
class Route:
    name: str
    tenants: tuple[str, ...]
    models: tuple[str, ...]
    limits: Limits = field(default_factory=Limits)
    failover: bool = True
    slo_ttft_ms: float | None = None  # defaults for x-slo-ttft-ms / x-slo-tpot-ms
    slo_tpot_ms: float | None = None
    on_slo_miss: Literal["best_effort", "queue", "fallback"] = "best_effort"
    queue_ms: float = 500.0  # how long "queue" (and flex under overload) may wait
    timeouts: Timeouts = field(default_factory=Timeouts)  # the settings' with overrides
    hold_timeout_ms: float = 60_000.0  # how long a request waits for a pool at zero to wake


@dataclass(frozen=True, slots=True)
class Policy:
    models: Mapping[str, Model]
    tenants: Mapping[str, Tenant]
    routes: Mapping[str, Route]
    settings: Settings
    source: str = "<memory>"
    key_index: Mapping[str, tuple[str, str]] = field(default_factory=dict)  # digest->(t, k)

    def route_for(self, tenant: str, model: str) -> Route | None:
        for r in self.routes.values():
            if tenant in r.tenants and model in r.models:
                return r
        return None

    def models_for(self, tenant: str) -> list[str]:
        seen: dict[str, None] = {}
        for r in self.routes.values():
            if tenant in r.tenants:
                seen.update(dict.fromkeys(r.models))
        return list(seen)


def _tenant(d: Decoder, name: str, raw: Any, path: str) -> Tenant:
    m = d.mapping(raw, path, schema.keys("tenant"), schema.required("tenant"))
    if not isinstance(m["keys"], list) or not m["keys"]:
        raise d.fail(f"{path}.keys", "expected a non-empty list of keys")
    keys = []
    for i, k in enumerate(m["keys"]):
        p = f"{path}.keys[{i}]"
        km = d.mapping(k, p, schema.keys("key"), schema.required("key"))
        digest = d.string(km["sha256"], f"{p}.sha256").lower()
        if not _HEX64.match(digest):
            raise d.fail(f"{p}.sha256", "expected the key's SHA-256 as 64 hex digits")
        keys.append(Key(str(km.get("name", f"key{i}")), digest))
    ml = m.get("model_limits") or {}
    if not isinstance(ml, Mapping):
        raise d.fail(f"{path}.model_limits", "expected a mapping of model to limits")
    model_limits = {str(k): parse_limits(d, v, f"{path}.model_limits.{k}") for k, v in ml.items()}
    bands = {"critical", "standard", "flex"}
    priority = d.choice(m.get("priority", "standard"), f"{path}.priority", bands)
    ceiling = d.choice(m["max_priority"], f"{path}.max_priority", bands) \
        if "max_priority" in m else None
    if ceiling is not None and PRIORITY_RANK[ceiling] < PRIORITY_RANK[priority]:
        raise d.fail(f"{path}.max_priority", f"is below the tenant's priority ({priority})")
    weight = d.number(m["weight"], f"{path}.weight") if "weight" in m else 1.0
    rv = m.get("reserved") or {}
    if not isinstance(rv, Mapping):
        raise d.fail(f"{path}.reserved", "expected a mapping of model to tokens per minute "
                     "or a percentage of its pool")
    reserved: dict[str, float] = {}
    shares: dict[str, float] = {}
    for k, v in rv.items():
        if isinstance(v, str) and v.strip().endswith("%"):
            pct = _percent(d, v, f"{path}.reserved.{k}")
            shares[str(k)] = pct / 100.0
        else:
            reserved[str(k)] = d.number(v, f"{path}.reserved.{k}")
    return Tenant(name, tuple(keys), parse_limits(d, m.get("limits"), f"{path}.limits"),
                  model_limits, priority, ceiling, weight, reserved, shares)


def _percent(d: Decoder, raw: str, path: str) -> float:
    try:
        pct = float(raw.strip()[:-1])
    except ValueError:
        raise d.fail(path, f"expected tokens per minute or a percentage like '25%', got "
                     f"{raw!r}") from None
    if not 0.0 < pct <= 100.0:
        raise d.fail(path, f"a share of the pool is more than 0% and at most 100%, got {raw!r}")
    return pct


def parse_policy(doc: Any, source: str = "<memory>") -> Policy:
    d = Decoder(source)
    top = d.mapping(doc, "", schema.keys("top"), schema.required("top"))
    if top.get("version", 1) != 1:
        raise d.fail("version", "only version 1 is supported")
    models_raw = d.mapping(top["models"], "models", set(top["models"] or {}))
    models = {str(n): parse_model(d, str(n), r, f"models.{n}") for n, r in models_raw.items()}
    if not models:
        raise d.fail("models", "at least one model is required")
    tenants_raw = d.mapping(top["tenants"], "tenants", set(top["tenants"] or {}))
    tenants = {str(n): _tenant(d, str(n), r, f"tenants.{n}") for n, r in tenants_raw.items()}
    settings = parse_settings(d, top.get("settings"))
    routes_raw = d.mapping(top["routes"], "routes", set(top["routes"] or {}))
    routes = {}
    for n, r in routes_raw.items():
        p = f"routes.{n}"
        rm = d.mapping(r, p, schema.keys("route"), schema.required("route"))
        failover = rm.get("failover", True)
        if not isinstance(failover, bool):
            raise d.fail(f"{p}.failover", "expected true or false")
        slo = d.mapping(rm.get("slo") or {}, f"{p}.slo", schema.keys("slo"))
        routes[str(n)] = Route(
            str(n), d.strings(rm["tenants"], f"{p}.tenants"),
            d.strings(rm["models"], f"{p}.models"),
            parse_limits(d, rm.get("limits"), f"{p}.limits"), failover,
            d.number(slo["ttft_ms"], f"{p}.slo.ttft_ms") if "ttft_ms" in slo else None,
            d.number(slo["tpot_ms"], f"{p}.slo.tpot_ms") if "tpot_ms" in slo else None,
            d.choice(rm.get("on_slo_miss", "best_effort"), f"{p}.on_slo_miss",
                     {"best_effort", "queue", "fallback"}),
            d.number(rm.get("queue_ms", 500.0), f"{p}.queue_ms"),
            replace(settings.timeouts, **partial_timeouts(d, rm.get("timeouts"),
                                                          f"{p}.timeouts")),
            d.number(rm.get("hold_timeout_ms", 60_000.0), f"{p}.hold_timeout_ms"))
    # -- cross references --
    for m in models.values():
        for i, fb in enumerate(m.fallback):
            if fb not in models:
                raise d.fail(f"models.{m.name}.fallback[{i}]", f"unknown model {fb!r}")
            if fb == m.name:
                raise d.fail(f"models.{m.name}.fallback[{i}]", "a model cannot fall back to "
                             "itself")
    for m in models.values():
        _check_cycle(d, models, m.name)
        if m.spillover is not None:
            if m.spillover not in models:
                raise d.fail(f"models.{m.name}.spillover", f"unknown model {m.spillover!r}")
            if m.spillover == m.name:
                raise d.fail(f"models.{m.name}.spillover", "a pool cannot spill over to itself")
    for t in tenants.values():
        for model_name in t.model_limits:
            if model_name not in models:
                raise d.fail(f"tenants.{t.name}.model_limits.{model_name}", "unknown model")
        for model_name in (*t.reserved, *t.reserved_share):
            if model_name not in models:
                raise d.fail(f"tenants.{t.name}.reserved.{model_name}", "unknown model")
            if model_name in t.reserved_share and not models[model_name].capacity_tpm:
                raise d.fail(f"tenants.{t.name}.reserved.{model_name}", "a share of the pool "
                             f"needs models.{model_name}.capacity_tpm (what one endpoint serves)")
    for r in routes.values():
        for i, tname in enumerate(r.tenants):
            if tname not in tenants:
                raise d.fail(f"routes.{r.name}.tenants[{i}]", f"unknown tenant {tname!r}")
        for i, mn in enumerate(r.models):
            if mn not in models:
                raise d.fail(f"routes.{r.name}.models[{i}]", f"unknown model {mn!r}")
    index: dict[str, tuple[str, str]] = {}
    for t in tenants.values():
        for i, k in enumerate(t.keys):
            if k.sha256 in index:
                raise d.fail(f"tenants.{t.name}.keys[{i}].sha256",
                             f"the same key is already given to tenant {index[k.sha256][0]!r}")
            index[k.sha256] = (t.name, k.name)
    routed = {t for r in routes.values() for t in r.tenants}
    for t in tenants.values():
        if t.name not in routed:
            raise d.fail(f"tenants.{t.name}", "no route includes this tenant: its keys would "
                         "reach no model (add it to a route's tenants, or remove it)")
    return Policy(models, tenants, routes, settings, source, index)


def _check_cycle(d: Decoder, models: Mapping[str, Model], start: str) -> None:
    seen = [start]
    frontier = list(models[start].fallback)
    while frontier:
        name = frontier.pop()
        if name == start:
            raise d.fail(f"models.{start}.fallback", f"fallback cycle through {' -> '.join(seen)}")
        if name in seen:
            continue
        seen.append(name)
        frontier.extend(models[name].fallback)


def load_policy(path: str | Path) -> Policy:
    p = Path(path)
    try:
        doc = yaml.safe_load(p.read_text())
    except OSError as exc:
        raise PolicyError(f"{p}: cannot read: {exc.strerror or exc}") from exc
    except yaml.YAMLError as exc:
        raise PolicyError(f"{p}: not valid YAML: {exc}") from exc
    return parse_policy(doc, str(p))
