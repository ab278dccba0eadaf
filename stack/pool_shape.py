"""The policy ``tokengate up`` serves: the user's file, reshaped by the pool flags
(``PoolShape``: ``--backends``, ``--pd``, ``--strategy``, ``--kv-pool-gb`` ...), its loopback
endpoints made real vLLM instances (``--engine vllm``) or given KV event streams (a precise
index), and port-0 endpoints given free ports, in a rewritten file when anything changed.
The simulator shapes its policies with the same ``PoolShape``."""

from __future__ import annotations

import os
import socket
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import yaml

from engines import vllm
from gateway.config.policy import Policy, load_policy
from protocol.loopback import free_port


@dataclass(slots=True)
class PoolShape:
    """``tokengate up`` flags that reshape one pool of the policy (``None``: keep it)."""

    pool: str | None = None
    strategy: str | None = None
    index: str | None = None
    backends: int | None = None
    pd: str | None = None  # "P:D"
    model: str | None = None
    hardware: str | None = None
    no_quota: bool = False
    max_batched_tokens: int | None = None
    tensor_parallel: int | None = None
    kv_offload_gb: float | None = None  # host memory per backend for offloaded KV
    kv_pool_gb: float | None = None  # one shared KV pool for the pool's backends
    gpu_only_routing: bool = False  # routing.kv_tiers false: price GPU-resident prefixes only

    def apply(self, raw: dict[str, Any]) -> bool:
        """Rewrite the policy document in place; True when anything changed."""
        models = raw.get("models") or {}
        if not models:
            return False
        name = self.pool or ("demo-large" if "demo-large" in models else next(iter(models)))
        if name not in models:
            raise ValueError(f"--pool {name!r}: the policy has no such model")
        m = models[name]
        changed = False
        if self.backends is not None and self.pd is not None:
            raise ValueError("--backends and --pd are alternatives")
        if self.backends is not None:
            if self.backends < 1:
                raise ValueError("--backends must be at least 1")
            m["endpoints"] = [{"url": "http://127.0.0.1:0/v1"} for _ in range(self.backends)]
            changed = True
        if self.pd is not None:
            try:
                p, d = (int(x) for x in self.pd.split(":"))
            except ValueError:
                raise ValueError(f"--pd expects P:D (e.g. 2:2), got {self.pd!r}") from None
            if p < 1 or d < 1:
                raise ValueError("--pd needs at least one prefill and one decode backend")
            m["endpoints"] = ([{"url": "http://127.0.0.1:0/v1", "role": "prefill"}] * p
                              + [{"url": "http://127.0.0.1:0/v1", "role": "decode"}] * d)
            m["endpoints"] = [dict(e) for e in m["endpoints"]]
            changed = True
        for flag, key in ((self.model, "model"), (self.hardware, "hardware"),
                          (self.max_batched_tokens, "max_num_batched_tokens"),
                          (self.tensor_parallel, "tensor_parallel")):
            if flag:
                m.setdefault("backend", {})[key] = flag
                changed = True
        if self.kv_offload_gb:
            m.setdefault("backend", {})["kv_offload_gb"] = self.kv_offload_gb
            changed = True
        if self.kv_pool_gb:
            m.setdefault("backend", {})["kv_pool_gb"] = self.kv_pool_gb
            m.setdefault("kv_pool", {"url": "http://127.0.0.1:0"})
            changed = True
        if self.gpu_only_routing:
            m.setdefault("routing", {})["kv_tiers"] = False
            changed = True
        for flag, key in ((self.strategy, "strategy"), (self.index, "index")):
            if flag:
                m.setdefault("routing", {})[key] = flag
                changed = True
        if self.no_quota:
            for section in ("models", "tenants", "routes"):
                for item in (raw.get(section) or {}).values():
                    if isinstance(item, dict):
                        changed |= item.pop("limits", None) is not None
                        changed |= item.pop("model_limits", None) is not None
        return changed


def loopback(host: str | None) -> bool:
    return host in ("127.0.0.1", "localhost", "::1")


def resolve_ports(path: str, shape: PoolShape | None = None, engine: str = "reference"
                  ) -> tuple[str, Policy]:
    """Apply the pool-shaping flags and give port-0 loopback endpoints free ports; return the
    policy file to serve."""
    load_policy(path)  # the user's file must be valid as written: errors name it
    raw = yaml.safe_load(Path(path).read_text())
    changed = shape.apply(raw) if shape is not None else False
    if engine == "vllm":
        changed |= _for_vllm(raw)
    else:
        changed |= _kv_streams(raw)
    for model in (raw.get("models") or {}).values():
        for ep in [*(model.get("endpoints") or []), *([model["kv_pool"]]
                                                      if model.get("kv_pool") else [])]:
            u = urlsplit(ep["url"])
            if loopback(u.hostname) and u.port == 0:
                ep["url"] = urlunsplit(u._replace(netloc=f"{u.hostname}:{free_port()}"))
                changed = True
    if not changed:
        return path, load_policy(path)
    fd, tmp = tempfile.mkstemp(prefix="tokengate-policy-", suffix=".yaml")
    with os.fdopen(fd, "w") as f:
        yaml.safe_dump(raw, f, sort_keys=False)
    return tmp, load_policy(tmp)


def _for_vllm(raw: dict[str, Any]) -> bool:
    """Each loopback endpoint becomes a real vLLM instance: the models count with the served
    model's own tokenizer and chat template, and every endpoint gets a KV event stream (vLLM
    connects to 127.0.0.1:P, the gateway binds; its replay socket on P+1)."""
    changed = False
    model = str(vllm.model_dir())
    for m in (raw.get("models") or {}).values():
        eps = [ep for ep in m.get("endpoints") or [] if loopback(urlsplit(ep["url"]).hostname)]
        if not eps:
            continue
        m["tokenizer"] = model
        m.pop("chat_template", None)
        for ep in eps:
            port = _port_pair()
            ep["kv_events"] = {"endpoint": f"tcp://127.0.0.1:{port}",
                               "replay": f"tcp://127.0.0.1:{port + 1}", "topic": "kv"}
        changed = True
    return changed


def _kv_streams(raw: dict[str, Any]) -> bool:
    """Reference backends of a precise pool publish KV events (the gateway binds where they
    connect, as with vLLM), unless the policy already says where."""
    changed = False
    for m in (raw.get("models") or {}).values():
        if (m.get("routing") or {}).get("index") != "precise":
            continue
        pool = m.get("kv_pool")
        for ep in [*(m.get("endpoints") or []), *([pool] if pool else [])]:
            if loopback(urlsplit(ep["url"]).hostname) and "kv_events" not in ep:
                port = _port_pair()
                ep["kv_events"] = {"endpoint": f"tcp://127.0.0.1:{port}",
                                   "replay": f"tcp://127.0.0.1:{port + 1}", "topic": "kv"}
                changed = True
    return changed


def _port_pair() -> int:
    for _ in range(100):
        p = free_port()
        if port_free("127.0.0.1", p + 1):
            return p
    raise RuntimeError("no two free neighbouring ports for a KV event stream")


def port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        # As the servers themselves bind: connections of a stopped server lingering in
        # TIME_WAIT do not make the port busy.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True
