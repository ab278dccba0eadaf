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
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from backend.config import KVPOOL_TOKEN_ENV
from engines import vllm
from gateway.config.endpoint import Endpoint, KVEvents
from gateway.config.policy import Model, Policy, Settings
from gateway.front.process import ServeConfig, serve
from protocol.loopback import DEMO_KEY, free_port
from protocol.runtime import freeze_startup_heap
from stack.behind_envoy import behind_envoy
from stack.pool_shape import PoolShape, loopback, port_free, resolve_ports


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
    envoy: bool = False  # a real Envoy on the port, tokengate its EPP (stack.behind_envoy)
    flow_mode: str | None = None  # --flow-control: overrides the policy's mode
    keep_logs: bool = False  # keep the temp dir of logs at exit (a --log-dir always stays)
    children: list[subprocess.Popen[bytes]] = field(default_factory=list)
    # The shared secret of the KV pools this launcher starts and their backends (one per run).
    kvpool_token: str = field(default_factory=lambda: secrets.token_urlsafe(24))
    engines: list[subprocess.Popen[bytes]] = field(default_factory=list)  # real vLLMs


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
            if not loopback(u.hostname) or u.port is None:
                continue
            kv = ep.kv_events
            spec = vllm.VllmSpec(
                port=u.port, served_name=m.upstream_name, core=cores[len(specs) % len(cores)],
                kv_events_port=int(kv.endpoint.rsplit(":", 1)[1]) if kv else None,
                nixl_port=free_port(),
                extra_args=["--scheduling-policy", "priority"]
                if policy.settings.flow_control.engine_priority else [])
            log = log_dir / f"vllm-{u.port}.log"
            cfg.engines.append(vllm.start(spec, log, model))
            specs.append((spec, log))
    print(f"tokengate up: starting {len(specs)} vLLM instance(s); logs in {log_dir}",
          file=sys.stderr, flush=True)
    for (spec, log), proc in zip(specs, cfg.engines, strict=True):
        vllm.wait_ready(spec, proc, log, timeout_s=120 + 60 * len(specs))


def _check_ports(cfg: UpConfig, policy: Policy) -> None:
    busy = set()
    for m in policy.models.values():
        for ep in m.endpoints:
            u = urlsplit(ep.url)
            if loopback(u.hostname) and u.port and not port_free(u.hostname or "", u.port):
                busy.add(u.netloc)
    if busy:
        raise RuntimeError(f"backend port(s) already in use: {', '.join(sorted(busy))}; stop what "
                           "listens there, or write port 0 in the policy to get free ones")
    if not port_free(cfg.host, cfg.port):
        raise RuntimeError(f"gateway port {cfg.host}:{cfg.port} is already in use; pass --port")


def start_backends(cfg: UpConfig, policy: Policy) -> list[str]:
    """A reference backend per loopback endpoint. Models that list the same endpoint share
    one backend (``--models``), switched as the first of them says (``backend.pooling``)."""
    _check_ports(cfg, policy)
    log_dir = Path(cfg.log_dir or tempfile.mkdtemp(prefix="tokengate-up-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    urls = []
    shared: dict[str, list[tuple[Model, Endpoint, str | None]]] = {}
    for m in policy.models.values():
        pool = _start_pool(cfg, m, log_dir)
        if pool is not None:
            urls.append(pool)
        for ep in m.endpoints:
            u = urlsplit(ep.url)
            if loopback(u.hostname) and u.port is not None:
                shared.setdefault(u.netloc, []).append((m, ep, pool))
    for netloc, members in shared.items():
        u = urlsplit(members[0][1].url)
        log = open(log_dir / f"backend-{u.port}.log", "wb")  # noqa: SIM115 - child's stderr
        cmd = _backend_cmd(cfg, members)
        if policy.settings.flow_control.engine_priority:  # the gateway sends a ``priority``
            cmd += ["--scheduling-policy", "priority"]
        cfg.children.append(subprocess.Popen(cmd, stdout=log,
                                             stderr=log, env=_pool_env(cfg)))
        log.close()
        urls.append(f"{u.scheme}://{netloc}")
    return urls


def _backend_cmd(cfg: UpConfig, members: list[tuple[Model, Endpoint, str | None]]
                 ) -> list[str]:
    m, ep, pool = members[0]
    u = urlsplit(ep.url)
    cmd = [sys.executable, "-m", "tokengate", "backend", "--host", u.hostname or "",
           "--port", str(u.port), "--hardware", m.backend.sim_hardware,
           "--time-scale", str(cfg.time_scale), "--role", ep.role]
    names = list(dict.fromkeys(f"{x.upstream_name}={x.backend.model}" for x, _, _ in members))
    if len(names) > 1:
        cmd += ["--models", ",".join(names), "--pooling", m.backend.pooling]
    else:
        cmd += ["--model", m.backend.model, "--served-model-name", m.upstream_name]
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
    return cmd


def _events_flag(kv: KVEvents) -> str:
    return json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                       "endpoint": kv.endpoint, "replay_endpoint": kv.replay,
                       "topic": kv.topic})


def _start_pool(cfg: UpConfig, m: Model, log_dir: Path) -> str | None:
    """``--kv-pool-gb``: the model's shared KV pool, when it is on loopback."""
    pool = m.kv_pool
    if pool is None or not m.backend.kv_pool_gb:
        return None
    u = urlsplit(pool.url)
    if not loopback(u.hostname) or u.port is None:
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
             "--log-level", "warning",
             *(["--flow-control", cfg.flow_mode] if cfg.flow_mode else [])]))
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


def admin_key_source(s: Settings) -> str:
    """Where ``/admin/*`` takes its key from, for the person who just started the stack."""
    if s.admin_key_sha256:
        return "admin endpoints (/admin/*): the key whose SHA-256 is settings.admin_key_sha256"
    if s.admin_key_env and os.environ.get(s.admin_key_env):
        return f"admin endpoints (/admin/*): the key in ${s.admin_key_env}"
    if s.admin_key_env:
        return (f"admin endpoints (/admin/*) are off: set ${s.admin_key_env} to a key of your "
                f"choice before starting, e.g. {s.admin_key_env}=$(openssl rand -hex 16)")
    return ("admin endpoints (/admin/*) are off: the policy names no admin key "
            "(settings.admin_key_env or settings.admin_key_sha256)")


async def up(cfg: UpConfig) -> None:
    path, policy = resolve_ports(cfg.policy, cfg.shape, cfg.engine)
    made = cfg.log_dir is None  # a temp dir of ours: removed at exit unless kept or failed
    logs = cfg.log_dir = cfg.log_dir or tempfile.mkdtemp(prefix="tokengate-up-")
    failed = True
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
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):  # a closed terminal too
            loop.add_signal_handler(sig, stop.set)
        serve_cfg = ServeConfig(path, cfg.host, cfg.port, cfg.redis_url,
                                flow_mode=cfg.flow_mode)
        if cfg.envoy:  # replicas of the data plane: more Envoys sharing the one EPP
            replicas = [free_port() for _ in range(cfg.replicas - 1)]
            task = asyncio.ensure_future(behind_envoy(path, cfg.host, cfg.port, cfg.redis_url,
                                                      ready=ready, stop=stop,
                                                      more_ports=replicas))
        else:
            replicas = start_replicas(cfg, path)
            task = asyncio.ensure_future(serve(serve_cfg, ready=ready, stop=stop))
        await asyncio.wait([task, asyncio.ensure_future(ready.wait())],
                           return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            task.result()
        freeze_startup_heap()  # the gateway started in this process, which is the program's
        key = (DEMO_KEY if hashlib.sha256(DEMO_KEY.encode()).hexdigest() in policy.key_index
               else "<a key of your policy>")
        print(f"OPENAI_BASE_URL=http://{cfg.host}:{serve_cfg.port}/v1", flush=True)
        print(f"OPENAI_API_KEY={key}", flush=True)
        if replicas:
            more = ",".join(f"http://{cfg.host}:{port}/v1" for port in replicas)
            print(f"TOKENGATE_REPLICAS={more}", flush=True)
        print(admin_key_source(policy.settings), file=sys.stderr, flush=True)
        print(f"tokengate up: logs in {logs}"  # after the two lines a user pastes
              + (" (removed at exit; --keep-logs keeps them)" if made and not cfg.keep_logs
                 else ""), file=sys.stderr, flush=True)
        await task
        failed = False
    finally:
        stop_children(cfg)
        if path != cfg.policy:
            with contextlib.suppress(OSError):
                os.unlink(path)
        if made and not cfg.keep_logs and not failed:
            shutil.rmtree(logs, ignore_errors=True)
        elif made and failed:
            print(f"tokengate up: logs kept in {logs}", file=sys.stderr, flush=True)
