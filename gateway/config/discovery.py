"""A model's ``discovery:`` section: its endpoints found at run time instead of listed -- the
pods an InferencePool selects (through the Kubernetes API), or the addresses a headless
Service's DNS name resolves to (``gateway.discovery``)."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any, Literal

from gateway.config import schema
from gateway.config.decode import Decoder


@dataclass(frozen=True, slots=True)
class Discovery:
    kind: Literal["inference_pool", "dns"]
    name: str  # the InferencePool's name, or the DNS name to resolve
    namespace: str | None = None  # inference_pool: default the gateway's own namespace
    port: int | None = None  # dns: the engines' port (a pool names its targetPorts)
    scheme: str = "http"
    path: str = "/v1"  # each endpoint's URL: scheme://ip:port + path
    interval_s: float = 5.0  # dns: how often the name is resolved again
    kubeconfig: str | None = None  # inference_pool: default in-cluster, else $KUBECONFIG
    api_key_env: str | None = None  # the bearer key sent to every discovered endpoint
    role_label: str = "llm-d.ai/role"  # a pod label saying prefill or decode (else both)

    def url(self, ip: str, port: int) -> str:
        host = f"[{ip}]" if ":" in ip else ip
        return f"{self.scheme}://{host}:{port}{self.path}"


def parse_discovery(d: Decoder, raw: Any, path: str) -> Discovery:
    m = d.mapping(raw, path, schema.keys("discovery"))
    kinds = [k for k in ("inference_pool", "dns") if k in m]
    if len(kinds) != 1:
        raise d.fail(path, "expected exactly one of inference_pool (an InferencePool's name) "
                     "or dns (a headless Service's name)")
    kind: Literal["inference_pool", "dns"] = "dns" if kinds[0] == "dns" else "inference_pool"
    kw: dict[str, Any] = {}
    kw.update(d.fields(m, path, ("namespace", "kubeconfig", "api_key_env", "role_label"), d.string))
    if "port" in m:
        port = d.integer(m["port"], f"{path}.port")
        if port > 65535:
            raise d.fail(f"{path}.port", f"expected a TCP port, got {port}")
        kw["port"] = port
    if kind == "inference_pool" and importlib.util.find_spec("kubernetes") is None:
        raise d.fail(f"{path}.inference_pool", "discovery from an InferencePool needs the "
                     "Kubernetes client: pip install 'tokengate[kubernetes]'")
    if kind == "dns" and "port" not in kw:
        raise d.fail(f"{path}.port", "dns discovery needs the engines' port")
    if kind == "dns" and ("namespace" in kw or "kubeconfig" in kw):
        raise d.fail(path, "namespace and kubeconfig belong to inference_pool discovery")
    if "scheme" in m:
        if m["scheme"] not in ("http", "https"):
            raise d.fail(f"{path}.scheme", "expected http or https")
        kw["scheme"] = m["scheme"]
    if "path" in m:
        p = d.string(m["path"], f"{path}.path")
        if not p.startswith("/"):
            raise d.fail(f"{path}.path", f"expected a URL path such as /v1, got {p!r}")
        kw["path"] = p.rstrip("/") or ""
    if "interval_s" in m:
        kw["interval_s"] = d.number(m["interval_s"], f"{path}.interval_s")
    return Discovery(kind, d.string(m[kinds[0]], f"{path}.{kinds[0]}"), **kw)
