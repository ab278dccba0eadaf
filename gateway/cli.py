"""``tokengate serve`` and ``tokengate epp``: the gateway's command line (argument parsing
only; the one place its environment is read)."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

from gateway.config.flow import FLOW_MODES
from protocol.logs import add_log_args
from protocol.runtime import run_loop

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
    p.add_argument("--flow-control", choices=FLOW_MODES, default=None,
                   help="how requests wait when a pool is saturated (overrides the policy's "
                   "settings.flow_control.mode): fcfs (no gateway queue), priority, "
                   "round_robin or fair")
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

    from gateway.front.process import ServeConfig, serve

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
            if ns.flow_control:
                cmd += ["--flow-control", ns.flow_control]
            children.append(subprocess.Popen(cmd))
    try:
        run_loop(serve(ServeConfig(ns.policy, ns.host, ns.port, ns.redis, reuse,
                               ns.drain_timeout, flow_mode=ns.flow_control),
                       handle_signals=True))
    finally:
        for c in children:
            c.terminate()
        for c in children:
            c.wait(ns.drain_timeout + 5)
    return 0


def guarded(command: str, main: Callable[[], int]) -> int:
    """``main``'s exit status; a bad policy or flag, or a start that fails (a port in use, a
    missing program), is one line ``tokengate COMMAND: why`` and status 2; Ctrl-C is 0."""
    from gateway.config.policy import PolicyError

    try:
        return main()
    except (PolicyError, ValueError, RuntimeError, OSError) as exc:
        print(f"tokengate {command}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 0


def run(ns: argparse.Namespace) -> int:
    def epp() -> int:
        from gateway.epp.server import EPPConfig, serve_epp

        run_loop(serve_epp(EPPConfig(ns.policy, ns.host, ns.port, ns.http_port, ns.redis,
                                     ns.drain_timeout), handle_signals=True))
        return 0

    return guarded(ns.command, (lambda: _serve_workers(ns)) if ns.command == "serve" else epp)
