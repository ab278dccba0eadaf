"""deploy/k8s/gie/: the InferencePool and InferenceObjectives validate against the CRD schemas
GIE publishes (vendored in crds/), the core objects against Kubernetes' own, and the pieces
agree with each other and with what ``tokengate epp`` really does (its port, its health
service, its policy, the pods it picks from). The validator itself is checked to reject a
broken pool."""

from __future__ import annotations

import copy
import functools
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from gateway.config.policy import parse_policy
from gateway.epp.server import LIVENESS, READINESS, EPPConfig

GIE = Path(__file__).resolve().parent.parent / "deploy" / "k8s" / "gie"


def docs() -> list[dict[str, Any]]:
    return [d for p in sorted(GIE.glob("*.yaml")) for d in yaml.safe_load_all(p.read_text()) if d]


@functools.cache
def crd_schemas() -> dict[tuple[str, str], dict[str, Any]]:
    """(apiVersion, kind) -> the openAPIV3Schema of each vendored CRD version (GIE's and
    llm-d's in gie/crds, RBG's in rbg/crds)."""
    out = {}
    for p in [*(GIE / "crds").glob("*_*.yaml"),  # the CRDs, not their kustomization.yaml
              *(GIE.parent / "rbg" / "crds").glob("*_*.yaml")]:
        crd = yaml.load(p.read_text(), Loader=yaml.CSafeLoader)
        group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
        for v in crd["spec"]["versions"]:
            out[(f"{group}/{v['name']}", kind)] = v["schema"]["openAPIV3Schema"]
    return out


def validate_custom(doc: dict[str, Any]) -> None:
    schema = crd_schemas()[(doc["apiVersion"], doc["kind"])]
    jsonschema.validate(doc, schema, cls=jsonschema.Draft7Validator)


def by_kind(kind: str) -> list[dict[str, Any]]:
    return [d for d in docs() if d["kind"] == kind]


def test_the_crds_are_vendored_with_their_licence() -> None:
    for licence in ("LICENSE", "LICENSE.llm-d"):
        assert "Apache License" in (GIE / "crds" / licence).read_text()
    assert set(crd_schemas()) >= {("inference.networking.k8s.io/v1", "InferencePool"),
                                  ("llm-d.ai/v1alpha2", "InferenceObjective")}


@pytest.mark.parametrize("kind", ["InferencePool", "InferenceObjective"])
def test_inference_resources_validate_against_gies_crds(kind: str) -> None:
    found = by_kind(kind)
    assert found
    for doc in found:
        validate_custom(doc)


def test_the_validator_rejects_a_broken_pool() -> None:
    pool = by_kind("InferencePool")[0]
    for broken in ({"targetPorts": None}, {"endpointPickerRef": {"port": {"number": 9002}}},
                   {"endpointPickerRef": {"name": "x", "failureMode": "Sometimes"}}):
        bad = copy.deepcopy(pool)
        for k, v in broken.items():
            if v is None:
                del bad["spec"][k]
            else:
                bad["spec"][k] = v
        with pytest.raises(jsonschema.ValidationError):
            validate_custom(bad)


def test_core_objects_validate_against_kubernetes() -> None:
    core = [d for d in docs() if d["apiVersion"] in ("v1", "apps/v1")]
    assert {d["kind"] for d in core} >= {"ConfigMap", "Deployment", "Service", "StatefulSet"}
    for doc in core:
        kubernetes_validate.validate(doc, "1.30", strict=True)


def test_the_pieces_agree_with_each_other_and_with_the_epp() -> None:
    pool = by_kind("InferencePool")[0]["spec"]
    services = {d["metadata"]["name"]: d for d in by_kind("Service")}
    epp_service = services[pool["endpointPickerRef"]["name"]]
    port = pool["endpointPickerRef"]["port"]["number"]
    assert port == EPPConfig("p").port and port in {p["port"] for p in epp_service["spec"]["ports"]}
    deployment = next(d for d in by_kind("Deployment") if d["metadata"]["name"] == "tokengate-epp")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["args"][0] == "epp" and str(port) in container["args"]
    assert container["readinessProbe"]["grpc"] == {"port": port, "service": READINESS}
    assert container["livenessProbe"]["grpc"] == {"port": port, "service": LIVENESS}
    # the pods the pool selects are the ones the policy discovers: the policy names the pool
    sts = by_kind("StatefulSet")[0]
    assert sts["spec"]["template"]["metadata"]["labels"] == pool["selector"]["matchLabels"]
    cm = by_kind("ConfigMap")[0]
    policy = parse_policy(yaml.safe_load(cm["data"]["policy.yaml"]), "configmap")
    pool_name = by_kind("InferencePool")[0]["metadata"]["name"]
    assert [m.discovery.name for m in policy.models.values() if m.discovery] == [pool_name]
    # least rights: get that one pool, list and watch pods; bound to the EPP's account
    role = by_kind("Role")[0]
    assert {(r["resources"][0], tuple(r["verbs"])) for r in role["rules"]} == {
        ("inferencepools", ("get",)), ("pods", ("list", "watch"))}
    assert next(r for r in role["rules"] if r["resources"] == ["inferencepools"])[
        "resourceNames"] == [pool_name]
    binding = by_kind("RoleBinding")[0]
    account = deployment["spec"]["template"]["spec"]["serviceAccountName"]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account}]
    assert by_kind("ServiceAccount")[0]["metadata"]["name"] == account
    # objectives are named after the priorities the EPP reads from their names
    assert {o["metadata"]["name"] for o in by_kind("InferenceObjective")} == {
        "critical", "standard", "flex"}
    route = by_kind("HTTPRoute")[0]
    ref = route["spec"]["rules"][0]["backendRefs"][0]
    assert (ref["kind"], ref["name"]) == ("InferencePool", by_kind("InferencePool")[0][
        "metadata"]["name"])
