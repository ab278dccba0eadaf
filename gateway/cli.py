"""``tokengate serve``, ``tokengate epp`` and ``tokengate up``: the gateway's command line
(argument parsing only; the one place its environment is read)."""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING

from gateway.config.routing import STRATEGIES
from gateway.examples import DEMO_POLICY
from protocol.logs import add_log_args
from protocol.runtime import run_loop

if TYPE_CHECKING:
    from gateway.pool_shape import PoolShape



POLICY_HELP = "the policy YAML file (`tokengate policy example` prints one to start from)"


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("serve", help="run the gateway with a policy file")
    p.add_argument("--policy", required=True, help=POLICY_HELP)
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default: loopback only; 0.0.0.0 for all)")
    p.add_argument("--port", type=int, default=8080, help="port to listen on")
    p.add_argument("--redis", default=os.environ.get("TOKENGATE_REDIS_URL"),
                   help="redis://host:port/db or redis+cluster://host:port (env "
                   "TOKENGATE_REDIS_URL); in-memory limits when absent")
    p.add_argument("--workers", type=int, default=1, help="processes sharing the port")
    p.add_argument("--reuse-port", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="on SIGTERM, seconds open requests get to finish")
    add_log_args(p)
    e = sub.add_parser("epp", help="run tokengate as the Endpoint Picker (ext_proc) behind "
                       "Envoy: the Gateway API Inference Extension's protocol")
    e.add_argument("--policy", required=True, help=POLICY_HELP)
    e.add_argument("--host", default="127.0.0.1", help="address to listen on")
    e.add_argument("--port", type=int, default=9002, help="ext_proc and gRPC health")
    e.add_argument("--http-port", type=int, default=9090, help="/metrics, /ready, /admin/*")
    e.add_argument("--redis", default=os.environ.get("TOKENGATE_REDIS_URL"),
                   help="shared quotas and state across EPP replicas (env TOKENGATE_REDIS_URL)")
    e.add_argument("--drain-timeout", type=float, default=30.0,
                   help="on SIGTERM, seconds open streams get to finish")
    add_log_args(e)
    u = sub.add_parser("up", help="start the demo stack: reference backends and the gateway")
    u.add_argument("--policy", default=str(DEMO_POLICY),
                   help="policy YAML (default: the demo policy, `tokengate policy example demo`)")
    u.add_argument("--host", default="127.0.0.1", help="the gateway's address")
    u.add_argument("--port", type=int, default=8080, help="the gateway's port")
    u.add_argument("--redis", default=os.environ.get("TOKENGATE_REDIS_URL"),
                   help="redis://host:port/db for shared quotas (env TOKENGATE_REDIS_URL); "
                   "in-memory limits when absent")
    u.add_argument("--time-scale", type=float, default=1.0,
                   help="the backends' time scale (<1 runs faster)")
    u.add_argument("--log-dir", help="where the backends' logs go (default: a temp dir)")
    add_log_args(u, level="warning")
    u.add_argument("--replicas", type=int, default=1,
                   help="gateway processes sharing --redis, each on its own port")
    u.add_argument("--engine", choices=("reference", "vllm"), default="reference",
                   help="what serves the loopback endpoints: reference backends, or real vLLM "
                        "instances (the tiny model of 'make vllm'; KV events and NIXL wired)")
    u.add_argument("--envoy", action="store_true",
                   help="put a real Envoy on --port, with tokengate as its endpoint picker "
                        "(ext_proc; gateway/epp/configs/envoy-epp.yaml)")
    add_shape_args(u)


def add_shape_args(p: argparse.ArgumentParser) -> None:
    """The flags that reshape the demo pool, shared with ``tokengate simulate``."""
    g = p.add_argument_group("shape the demo pool (applied on top of --policy)")
    g.add_argument("--pool", help="the model whose pool the flags below shape (default: "
                   "demo-large, else the policy's first model)")
    g.add_argument("--strategy", choices=sorted(STRATEGIES), help="the pool's routing strategy")
    g.add_argument("--index", choices=("approximate", "precise"), help="prefix index mode")
    g.add_argument("--backends", type=int, help="N aggregated reference backends")
    g.add_argument("--pd", metavar="P:D", help="P prefill + D decode reference backends")
    g.add_argument("--model", dest="backend_model", help="model profile the backends simulate")
    g.add_argument("--hardware", help="hardware profile the backends simulate")
    g.add_argument("--tensor-parallel", type=int,
                   help="GPUs per backend (default: the model profile's degree)")
    g.add_argument("--max-batched-tokens", type=int,
                   help="the backends' per-step token budget (chunked prefill)")
    g.add_argument("--no-quota", action="store_true", help="drop every limit (benchmark runs)")
    g.add_argument("--kv-offload-gb", type=float,
                   help="host memory per backend (GB) keeping KV below the GPU cache")
    g.add_argument("--kv-pool-gb", type=float,
                   help="start one shared KV pool of this size (GB) and wire every backend "
                        "of the pool to it")
    g.add_argument("--gpu-only-routing", action="store_true",
                   help="route as if only GPU-resident prefixes were cached (comparison runs)")


def shape_of(ns: argparse.Namespace) -> PoolShape:
    from gateway.pool_shape import PoolShape

    return PoolShape(ns.pool, ns.strategy, ns.index, ns.backends, ns.pd, ns.backend_model,
                     ns.hardware, ns.no_quota, ns.max_batched_tokens, ns.tensor_parallel,
                     ns.kv_offload_gb, ns.kv_pool_gb, ns.gpu_only_routing)


def _has_limits(path: str) -> bool:
    from gateway.config.policy import load_policy

    p = load_policy(path)
    scopes = [*(t.limits for t in p.tenants.values()),
              *(lim for t in p.tenants.values() for lim in t.model_limits.values()),
              *(m.limits for m in p.models.values()), *(r.limits for r in p.routes.values())]
    return any(s.buckets() for s in scopes)


def _serve_workers(ns: argparse.Namespace) -> int:
    """Run ``serve``; with --workers N, N-1 more processes share the port (SO_REUSEPORT)."""
    import subprocess

    from gateway.process import ServeConfig, serve

    children = []
    reuse = ns.reuse_port or ns.workers > 1
    if ns.workers > 1:
        if ns.port == 0:
            raise ValueError("--workers needs a fixed --port")
        if not ns.redis and _has_limits(ns.policy):
            raise ValueError("--workers needs --redis when the policy sets limits: without a "
                             "shared store each worker would enforce every limit on its own "
                             "(N workers, N times the limits)")
        for _ in range(ns.workers - 1):
            cmd = [sys.executable, "-m", "tokengate", "serve", "--policy", ns.policy,
                   "--host", ns.host, "--port", str(ns.port), "--reuse-port",
                   "--drain-timeout", str(ns.drain_timeout), "--log-level", ns.log_level,
                   "--log-format", ns.log_format]
            if ns.redis:
                cmd += ["--redis", ns.redis]
            children.append(subprocess.Popen(cmd))
    try:
        run_loop(serve(ServeConfig(ns.policy, ns.host, ns.port, ns.redis, reuse,
                               ns.drain_timeout), handle_signals=True))
    finally:
        for c in children:
            c.terminate()
        for c in children:
            c.wait(ns.drain_timeout + 5)
    return 0


def run(ns: argparse.Namespace) -> int:
    from gateway.config.policy import PolicyError

    try:
        if ns.command == "serve":
            return _serve_workers(ns)
        if ns.command == "epp":
            from gateway.epp.server import EPPConfig, serve_epp

            run_loop(serve_epp(EPPConfig(ns.policy, ns.host, ns.port, ns.http_port, ns.redis,
                                         ns.drain_timeout), handle_signals=True))
            return 0
        from gateway.up import UpConfig, up

        if ns.envoy:
            from gateway.epp.envoy import binary

            binary()  # before anything starts: says how to install Envoy when it is missing
        shape = shape_of(ns)
        run_loop(up(UpConfig(ns.policy, ns.host, ns.port, ns.redis, ns.time_scale,
                             ns.log_dir, shape=shape, replicas=ns.replicas,
                             engine=ns.engine, envoy=ns.envoy)))
    except (PolicyError, ValueError, RuntimeError, OSError) as exc:
        print(f"tokengate {ns.command}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 0
    return 0
