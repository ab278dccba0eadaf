"""The configuration reference is the schema the parser validates with: regenerated, it is
the file in docs/; every default it states is the one the parser fills in; the example in it
loads."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from gateway.config import (
    endpoint,
    flow,
    policy,
    resilience,
    scaling,
    sentry,
    spend,
    tracing,
)
from gateway.config.backend_spec import BackendSpec
from gateway.config.policy import parse_policy
from gateway.config.reference import render
from gateway.config.routing import Routing
from gateway.config.schema import NONE, REQUIRED, SECTIONS, keys

ROOT = Path(__file__).resolve().parent.parent

DATACLASSES: dict[str, Any] = {
    "settings": policy.Settings, "timeouts": resilience.Timeouts,
    "retries": resilience.Retries, "client": resilience.ClientLimits,
    "tracing": tracing.Tracing, "model": policy.Model, "endpoint": endpoint.Endpoint,
    "kv_events": endpoint.KVEvents, "price": policy.Price, "limits": policy.Limits,
    "backend": BackendSpec, "routing": Routing, "scaling": scaling.Scaling,
    "launcher": scaling.Launcher, "kv_pool": endpoint.KVPool, "tenant": policy.Tenant,
    "key": policy.Key, "route": policy.Route, "flow_control": flow.FlowControl,
    "spend": spend.Spend, "sentry": sentry.SentryConfig}


def test_the_reference_in_docs_is_the_schema() -> None:
    assert (ROOT / "docs" / "configuration.md").read_text() == render(), (
        "regenerate: python -m gateway.config.reference > docs/configuration.md")


@pytest.mark.parametrize("section", sorted(DATACLASSES))
def test_each_stated_default_is_the_parsers(section: str) -> None:
    fields = {f.name: f for f in dataclasses.fields(DATACLASSES[section])}
    compared = 0
    for name, key in SECTIONS[section].keys.items():
        f = fields.get(name)
        if f is None or key.default is REQUIRED:
            continue
        if f.default is dataclasses.MISSING:  # a default_factory: a section of its own
            assert key.default is NONE or isinstance(key.default, str | list), (section, name)
            continue
        expected = None if key.default is NONE else key.default
        got = list(f.default) if isinstance(f.default, tuple) else f.default
        assert got == expected, (section, name, f.default, key.default)
        compared += 1
    assert compared or section == "key"


def test_every_section_is_reachable_and_every_key_documented() -> None:
    for name, section in SECTIONS.items():
        assert section.doc and section.keys, name
        for k, key in section.keys.items():
            assert key.doc.endswith((".", "…")) and key.type, (name, k)
    assert keys("limits") == {"rpm", "tpm", "burst", "tpd", "budget", "budget_daily",
                              "budget_monthly"}


def test_the_example_in_the_reference_loads() -> None:
    text = (ROOT / "docs" / "configuration.md").read_text()
    example = re.search(r"```yaml\n(.*?)```", text, re.S)
    assert example
    p = parse_policy(yaml.safe_load(example.group(1)), "reference")
    assert p.models["llama-70b"].fallback == ("llama-8b",)
