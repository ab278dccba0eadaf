"""The policy as the gateway resolved it (every default filled in, every route's timeouts
merged), as plain data without secrets: what ``/admin/policy`` answers and what
``tokengate policy check`` prints, so an operator can confirm a reload or a change."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from gateway.config.policy import Policy
from gateway.config.spend import redact_url

SET = "<set>"  # in place of a secret that is configured


def resolved(policy: Policy) -> dict[str, Any]:
    settings = asdict(policy.settings)
    settings["admin_key_sha256"] = SET if settings["admin_key_sha256"] else None
    models = {}
    for name, m in policy.models.items():
        d = asdict(m)
        for e in d["endpoints"]:
            e["api_key"] = SET if e["api_key"] else None
        models[name] = d
    tenants = {}
    for name, t in policy.tenants.items():
        d = asdict(t)
        d["keys"] = [k.name for k in t.keys]  # names only: digests identify keys
        d["max_priority"] = t.priority_ceiling
        tenants[name] = d
    shown: dict[str, Any] = _no_passwords({
        "source": policy.source, "settings": settings, "models": models, "tenants": tenants,
        "routes": {n: asdict(r) for n, r in policy.routes.items()}})
    return shown


def _no_passwords(v: Any) -> Any:
    """Every URL in ``v`` with its password shown as ``***`` (a database, an OTLP endpoint
    given with credentials)."""
    if isinstance(v, dict):
        return {k: _no_passwords(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [_no_passwords(x) for x in v]
    if isinstance(v, str) and "://" in v and "@" in v:
        try:
            return redact_url(v)
        except ValueError:
            return "<unreadable URL>"
    return v
