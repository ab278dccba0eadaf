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
    spend = settings["spend"]
    spend["postgres_url"] = redact_url(spend["postgres_url"])
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
    return {"source": policy.source, "settings": settings, "models": models,
            "tenants": tenants, "routes": {n: asdict(r) for n, r in policy.routes.items()}}
