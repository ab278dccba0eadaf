"""``tokengate up``: the demo stack's command line (argument parsing only), and the flags
that reshape the demo pool, which ``tokengate simulate`` shares."""

from __future__ import annotations

import argparse
import os

from gateway.cli import guarded
from gateway.config.flow import FLOW_MODES
from gateway.config.routing import STRATEGIES
from gateway.examples import DEMO_POLICY
from protocol.logs import add_log_args
from protocol.runtime import run_loop
from stack.pool_shape import PoolShape


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    u = sub.add_parser("up", help="start the demo stack: reference backends and the gateway",
                       description="Start engines (reference backends, or real vLLM) for the "
                       "policy's loopback endpoints and the gateway in front; print the two "
                       "lines an OpenAI client needs; Ctrl-C, SIGTERM or SIGHUP stops everything.")
    u.add_argument("--policy", default=str(DEMO_POLICY),
                   help="policy YAML (default: the demo policy, `tokengate policy example demo`)")
    u.add_argument("--host", default="127.0.0.1", help="the gateway's address")
    u.add_argument("--port", type=int, default=8080, help="the gateway's port")
    u.add_argument("--redis", default=os.environ.get("TOKENGATE_REDIS_URL"),
                   help="redis://host:port/db for shared quotas (env TOKENGATE_REDIS_URL); "
                   "in-memory limits when absent")
    u.add_argument("--time-scale", type=float, default=1.0,
                   help="the backends' time scale (<1 runs faster)")
    u.add_argument("--log-dir", help="where the backends' logs go (default: a temp dir, "
                   "removed at exit unless --keep-logs or a failure)")
    u.add_argument("--keep-logs", action="store_true",
                   help="keep the temp dir of logs at exit (a --log-dir is always kept)")
    add_log_args(u, level="warning")
    u.add_argument("--replicas", type=int, default=1,
                   help="gateway processes sharing --redis, each on its own port (with "
                        "--envoy: Envoys, each on its own port, sharing the one EPP)")
    u.add_argument("--engine", choices=("reference", "vllm"), default="reference",
                   help="what serves the loopback endpoints: reference backends, or real vLLM "
                        "instances (the tiny model of 'make vllm'; KV events and NIXL wired)")
    u.add_argument("--envoy", action="store_true",
                   help="put a real Envoy on --port, with tokengate as its endpoint picker "
                        "(ext_proc; gateway/epp/configs/envoy-epp.yaml)")
    u.add_argument("--flow-control", choices=FLOW_MODES, default=None,
                   help="how requests wait in the gateway when a pool is saturated "
                        "(overrides the policy's settings.flow_control.mode)")
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
    return PoolShape(ns.pool, ns.strategy, ns.index, ns.backends, ns.pd, ns.backend_model,
                     ns.hardware, ns.no_quota, ns.max_batched_tokens, ns.tensor_parallel,
                     ns.kv_offload_gb, ns.kv_pool_gb, ns.gpu_only_routing)




def run(ns: argparse.Namespace) -> int:
    def start() -> int:
        from stack.up import UpConfig, up

        if ns.envoy:
            from gateway.epp.envoy import binary

            binary()  # before anything starts: says how to install Envoy when it is missing
        run_loop(up(UpConfig(ns.policy, ns.host, ns.port, ns.redis, ns.time_scale,
                             ns.log_dir, shape=shape_of(ns), replicas=ns.replicas,
                             engine=ns.engine, envoy=ns.envoy, flow_mode=ns.flow_control,
                             keep_logs=ns.keep_logs)))
        return 0

    return guarded("up", start)
