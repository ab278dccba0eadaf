"""``tokengate up``: the whole demo stack in one command.

Starts a reference backend (a child process) for every loopback endpoint of the policy (its
model's ``backend:`` section says what it simulates; ``--engine vllm``: real vLLM), waits
until they have loaded, runs the gateway in front (``--envoy``: a real Envoy, tokengate its
EPP), prints the two lines a user pastes into a shell, and on Ctrl-C or SIGTERM drains the
gateway and stops every child. Port-0 endpoints get free ports (in a rewritten policy)."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import yaml

from engines import vllm
from gateway.config.endpoint import KVEvents
from gateway.config.policy import Model, Policy, load_policy
from gateway.epp.front import behind_envoy
from gateway.process import ServeConfig, serve
from protocol.loopback import DEMO_KEY, free_port


@dataclass(slots=True)
class UpConfig:
    policy: str
    host: str = "127.0.0.1"
    port: int = 8080
    redis_url: str | None = None
    time_scale: float = 1.0
    log_dir: str | None = None
    shape: PoolShape | None = None
    replicas: int = 1  # gateway processes, sharing --redis, each on its own port
    engine: str = "reference"  # or "vllm": real vLLM instances (engines.vllm)
    envoy: bool = False  # a real Envoy on the port, tokengate its EPP (gateway.epp.front)
    children: list[subprocess.Popen[bytes]] = field(default_factory=list)
    # The shared secret of the KV pools this launcher starts and their backends (one per run).
    kvpool_token: str = field(default_factory=lambda: secrets.token_urlsafe(24))
    engines: list[subprocess.Popen[bytes]] = field(default_factory=list)  # real vLLMs


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


def _loopback(host: str | None) -> bool:
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
            if _loopback(u.hostname) and u.port == 0:
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
        eps = [ep for ep in m.get("endpoints") or [] if _loopback(urlsplit(ep["url"]).hostname)]
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
            if _loopback(urlsplit(ep["url"]).hostname) and "kv_events" not in ep:
                port = _port_pair()
                ep["kv_events"] = {"endpoint": f"tcp://127.0.0.1:{port}",
                                   "replay": f"tcp://127.0.0.1:{port + 1}", "topic": "kv"}
                changed = True
    return changed


def _port_pair() -> int:
    for _ in range(100):
        p = free_port()
        if _port_free("127.0.0.1", p + 1):
            return p
    raise RuntimeError("no two free neighbouring ports for a KV event stream")


def start_vllm(cfg: UpConfig, policy: Policy) -> None:
    """One real vLLM per loopback endpoint, each bound to a core of its own (round robin over
    the cores this process may use), with prefix caching, KV events and the NixlConnector
    (``kv_both``: any instance can prefill for another)."""
    log_dir = Path(cfg.log_dir or tempfile.mkdtemp(prefix="tokengate-up-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    model = vllm.ensure_model()
    cores = sorted(os.sched_getaffinity(0))
    specs: list[tuple[vllm.VllmSpec, Path]] = []
    for m in policy.models.values():
        for ep in m.endpoints:
            u = urlsplit(ep.url)
            if not _loopback(u.hostname) or u.port is None:
                continue
            kv = ep.kv_events
            spec = vllm.VllmSpec(
                port=u.port, served_name=m.upstream_name, core=cores[len(specs) % len(cores)],
                kv_events_port=int(kv.endpoint.rsplit(":", 1)[1]) if kv else None,
                nixl_port=free_port())
            log = log_dir / f"vllm-{u.port}.log"
            cfg.engines.append(vllm.start(spec, log, model))
            specs.append((spec, log))
    print(f"tokengate up: starting {len(specs)} vLLM instance(s); logs in {log_dir}",
          file=sys.stderr, flush=True)
    for (spec, log), proc in zip(specs, cfg.engines, strict=True):
        vllm.wait_ready(spec, proc, log, timeout_s=120 + 60 * len(specs))


def _port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        # As the servers themselves bind: connections of a stopped server lingering in
        # TIME_WAIT do not make the port busy.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _check_ports(cfg: UpConfig, policy: Policy) -> None:
    busy = set()
    for m in policy.models.values():
        for ep in m.endpoints:
            u = urlsplit(ep.url)
            if _loopback(u.hostname) and u.port and not _port_free(u.hostname or "", u.port):
                busy.add(u.netloc)
    if busy:
        raise RuntimeError(f"backend port(s) already in use: {', '.join(sorted(busy))}; stop what "
                           "listens there, or write port 0 in the policy to get free ones")
    if not _port_free(cfg.host, cfg.port):
        raise RuntimeError(f"gateway port {cfg.host}:{cfg.port} is already in use; pass --port")


def start_backends(cfg: UpConfig, policy: Policy) -> list[str]:
    _check_ports(cfg, policy)
    log_dir = Path(cfg.log_dir or tempfile.mkdtemp(prefix="tokengate-up-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    urls = []
    for m in policy.models.values():
        pool = _start_pool(cfg, m, log_dir)
        if pool is not None:
            urls.append(pool)
        for ep in m.endpoints:
            u = urlsplit(ep.url)
            if not _loopback(u.hostname) or u.port is None:
                continue
            log = open(log_dir / f"backend-{u.port}.log", "wb")  # noqa: SIM115 - child's stderr
            cmd = [sys.executable, "-m", "tokengate", "backend", "--host", u.hostname or "",
                   "--port", str(u.port), "--model", m.backend.model, "--hardware",
                   m.backend.sim_hardware, "--served-model-name", m.upstream_name,
                   "--time-scale", str(cfg.time_scale), "--role", ep.role]
            if m.backend.max_num_batched_tokens:
                cmd += ["--max-num-batched-tokens", str(m.backend.max_num_batched_tokens)]
            if m.backend.tensor_parallel:
                cmd += ["--tensor-parallel", str(m.backend.tensor_parallel)]
            if ep.kv_events is not None:
                cmd += ["--kv-events-config", _events_flag(ep.kv_events)]
            if m.backend.kv_offload_gb:
                cmd += ["--kv-offload-gb", str(m.backend.kv_offload_gb)]
            if pool is not None:
                cmd += ["--kv-pool", pool]
            cfg.children.append(subprocess.Popen(cmd, stdout=log, stderr=log,
                                                 env=_pool_env(cfg)))
            log.close()
            urls.append(f"{u.scheme}://{u.netloc}")
    return urls


def _events_flag(kv: KVEvents) -> str:
    return json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                       "endpoint": kv.endpoint, "replay_endpoint": kv.replay,
                       "topic": kv.topic})


KVPOOL_TOKEN_ENV = "TOKENGATE_KVPOOL_TOKEN"  # what ``tokengate kvpool`` and backends read


def _start_pool(cfg: UpConfig, m: Model, log_dir: Path) -> str | None:
    """``--kv-pool-gb``: the model's shared KV pool, when it is on loopback."""
    pool = m.kv_pool
    if pool is None or not m.backend.kv_pool_gb:
        return None
    u = urlsplit(pool.url)
    if not _loopback(u.hostname) or u.port is None:
        return None
    log = open(log_dir / f"kvpool-{u.port}.log", "wb")  # noqa: SIM115 - child's stderr
    cmd = [sys.executable, "-m", "tokengate", "kvpool", "--host", u.hostname or "",
           "--port", str(u.port), "--capacity-gb", str(m.backend.kv_pool_gb)]
    if pool.kv_events is not None:
        cmd += ["--kv-events-config", _events_flag(pool.kv_events)]
    cfg.children.append(subprocess.Popen(cmd, stdout=log, stderr=log, env=_pool_env(cfg)))
    log.close()
    return f"{u.scheme}://{u.netloc}"


def _pool_env(cfg: UpConfig) -> dict[str, str]:
    return {**os.environ, KVPOOL_TOKEN_ENV: cfg.kvpool_token}


def wait_healthy(urls: list[str], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    pending = list(urls)
    while pending:
        url = pending[0]
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=1) as r:
                if r.status == 200:
                    pending.pop(0)
                    continue
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"backend {url} did not become healthy in {timeout_s:.0f}s")
        time.sleep(0.05)


def start_replicas(cfg: UpConfig, policy_path: str) -> list[int]:
    """``--replicas N``: N-1 more gateway processes on their own ports, sharing Redis (quotas,
    the predictor model and prefix hints), for a load balancer (or a test harness) to spread
    requests over. Their ports, once each answers /health."""
    if cfg.replicas <= 1:
        return []
    if not cfg.redis_url:
        raise ValueError("--replicas needs --redis: replicas share their state through it")
    ports = [free_port() for _ in range(cfg.replicas - 1)]
    for port in ports:
        cfg.children.append(subprocess.Popen(
            [sys.executable, "-m", "tokengate", "serve", "--policy", policy_path,
             "--host", cfg.host, "--port", str(port), "--redis", cfg.redis_url,
             "--log-level", "warning"]))
    wait_healthy([f"http://{cfg.host}:{port}" for port in ports], 60)
    return ports


def stop_children(cfg: UpConfig) -> None:
    for proc in cfg.engines:
        vllm.stop(proc)
    for p in cfg.children:
        if p.poll() is None:
            p.terminate()
    for p in cfg.children:
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


async def up(cfg: UpConfig) -> None:
    path, policy = resolve_ports(cfg.policy, cfg.shape, cfg.engine)
    try:
        if cfg.engine == "vllm":
            _check_ports(cfg, policy)
            start_vllm(cfg, policy)
        else:
            urls = start_backends(cfg, policy)
            wait_healthy(urls, 120 + 30 * cfg.time_scale)
        ready = asyncio.Event()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        serve_cfg = ServeConfig(path, cfg.host, cfg.port, cfg.redis_url)
        replicas = start_replicas(cfg, path)
        task = asyncio.ensure_future(behind_envoy(path, cfg.host, cfg.port, cfg.redis_url,
                                                  ready=ready, stop=stop) if cfg.envoy
                                     else serve(serve_cfg, ready=ready, stop=stop))
        await asyncio.wait([task, asyncio.ensure_future(ready.wait())],
                           return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            task.result()
        key = (DEMO_KEY if hashlib.sha256(DEMO_KEY.encode()).hexdigest() in policy.key_index
               else "<a key of your policy>")
        print(f"OPENAI_BASE_URL=http://{cfg.host}:{serve_cfg.port}/v1", flush=True)
        print(f"OPENAI_API_KEY={key}", flush=True)
        if replicas:
            more = ",".join(f"http://{cfg.host}:{port}/v1" for port in replicas)
            print(f"TOKENGATE_REPLICAS={more}", flush=True)
        await task
    finally:
        stop_children(cfg)
        if path != cfg.policy:
            with contextlib.suppress(OSError):
                os.unlink(path)
