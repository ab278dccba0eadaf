"""``tokengate backend``: the reference GPU backend's command line (argument parsing only; the
one place its environment is read). ``python -m backend.cli`` runs it without the dispatcher."""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import sys
from collections.abc import Sequence
from urllib.parse import urlsplit

from backend.config import (
    KV_LINKS,
    KVPOOL_TOKEN_ENV,
    LOOPBACK_PEERS,
    ROLES,
    BackendConfig,
)
from backend.engine_config import EngineConfig
from backend.events import KVEventsConfig
from backend.faults import FaultConfig
from backend.lora import LoraConfig
from backend.pooling import MODES, Mode, PoolingConfig
from protocol import logs
from protocol.logs import add_log_args
from protocol.runtime import run_loop
from roofline.switching import SOURCES, SwitchCost


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("backend", help="run a reference GPU backend (OpenAI-compatible)",
                       description="A simulated vLLM instance: continuous batching, paged KV "
                       "cache with prefix caching, roofline step timing.")
    a = p.add_argument
    a("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    a("--port", type=int, default=8000, help="port to listen on (0: any free port, printed)")
    a("--model", default="llama-3-8b", help="model profile (see --profiles)")
    a("--tensor-parallel", type=int, help="GPUs per instance (default: the profile's)")
    a("--hardware", default="h100-sxm", help="hardware profile: h100-sxm, h200, b200, a100-80g")
    a("--profiles", help="YAML/JSON file of extra hardware and model profiles")
    a("--role", choices=ROLES, default="both", help="prefill/decode disaggregation role")
    a("--time-scale", type=float, default=1.0,
      help="multiply every modelled duration (<1 runs faster)")
    a("--seed", type=int, default=0, help="random seed of output lengths and step noise")
    a("--served-model-name", help="model name clients use (default: the profile name)")
    a("--models", metavar="NAME[=PROFILE],...",
      help="host several models on this instance (each served as NAME, with the profile "
      "PROFILE or the profile named NAME); replaces --model and --served-model-name")
    a("--pooling", choices=MODES,
      help="how hosted models share the GPU: dedicated (one model), request (switch when the "
      "batch drains), token (switch between steps, by deadline); default token with --models")
    a("--weights-from", choices=SOURCES, default="host",
      help="where a switched-in model's weights come from (host memory over PCIe, or disk)")
    a("--naive-switch", action="store_true",
      help="re-initialise the engine on every switch (no Aegaeon-style component reuse)")
    a("--enable-lora", action="store_true",
      help="serve LoRA adapters of the (first) model, as vLLM --enable-lora")
    a("--max-loras", type=int, default=1, help="distinct adapters one batch may hold")
    a("--max-lora-rank", type=int, default=16, help="the largest adapter rank accepted")
    a("--lora-modules", nargs="+", metavar="NAME=PATH",
      help="adapters served from the start (PEFT directories)")
    a("--slo-ttft", type=float, default=2.0, help="TTFT deadline (s) of token-level pooling")
    a("--slo-tpot", type=float, default=0.05, help="TPOT deadline (s) of token-level pooling")
    a("--scheduling-policy", choices=("fcfs", "priority"), default="fcfs",
      help="the waiting queue's order (vLLM's): arrival, or a request's 'priority' (lower "
           "first, then arrival; a request's 'priority' is refused under fcfs)")
    a("--max-num-seqs", type=int, default=256,
      help="most requests in the running batch (vLLM's --max-num-seqs)")
    a("--max-num-batched-tokens", type=int, default=8192,
      help="token budget of one step, prefill chunks included (vLLM's flag)")
    a("--max-model-len", type=int, help="context limit (default: the profile's)")
    a("--image-tokens", type=int, default=0,
      help="serve image_url parts (base64 data URLs), each as this many prompt tokens, as a "
           "vision model's encoder would (0: images are refused)")
    a("--block-size", type=int, default=16, help="tokens per KV-cache block")
    a("--gpu-memory-utilization", type=float, default=0.9,
      help="fraction of GPU memory for weights and KV cache (vLLM's flag)")
    a("--num-gpu-blocks", type=int, help="override the memory-derived KV cache size")
    a("--no-prefix-caching", action="store_true",
      help="recompute every prompt (no reuse of cached prefix blocks)")
    a("--output-len", default="lognormal:256:0.8",
      help="length at which a request emits EOS: fixed:N | uniform:A:B | exponential:MEAN | "
           "lognormal:MEAN:SIGMA (capped by max_tokens; ignore_eos runs to max_tokens)")
    a("--jitter", type=float, default=0.03, help="log-normal sigma of step-time noise")
    a("--kv-link", choices=sorted(KV_LINKS), default="rdma",
      help="KV transfer link: rdma (400 Gb/s) or tcp (25 Gb/s)")
    a("--kv-link-gbps", type=float, help="KV link bandwidth in Gb/s (overrides --kv-link)")
    a("--kv-offload-gb", type=float, default=0.0,
      help="host memory (GB) that keeps KV blocks below the GPU cache, loaded back at the "
           "hardware profile's PCIe bandwidth instead of recomputed (vLLM's CPU offloading)")
    a("--kv-pool", metavar="URL",
      help="a shared KV pool (tokengate kvpool): blocks are put there and fetched over the "
           "--kv-link by any instance; its token is read from --kv-pool-token-env")
    a("--kv-pool-token-env", default=KVPOOL_TOKEN_ENV, metavar="NAME",
      help="the environment variable holding the KV pool's shared secret")
    a("--kv-hold-timeout", type=float, default=480.0,
      help="seconds a prefill instance keeps KV nobody pulled")
    a("--load-bandwidth", type=float, default=3.6,
      help="weight loading bandwidth in GB/s (cold start = weights / this)")
    a("--api-key", default=os.environ.get("TOKENGATE_BACKEND_API_KEY"),
      help="require this bearer key on /v1 and /admin (env TOKENGATE_BACKEND_API_KEY)")
    a("--max-body-mb", type=float, default=64.0,
      help="largest request body accepted, in MB (413 above)")
    a("--kv-events-config", metavar="JSON",
      help="publish KV-cache events over ZMQ, in vLLM's format and with vLLM's keys, e.g. "
           "'{\"enable_kv_cache_events\":true,\"publisher\":\"zmq\",\"endpoint\":"
           "\"tcp://127.0.0.1:5557\",\"replay_endpoint\":\"tcp://127.0.0.1:5558\"}'")
    a("--tokenizer", help="the served model's tokenizer: a model directory (tokenizer.json "
      "with its chat template), a tokenizer.json, or a tiktoken encoding")
    a("--kv-peer", action="append", metavar="CIDR",
      help="a network whose instances this one may pull KV from (repeatable; default "
           "loopback only: 127.0.0.0/8 and ::1)")
    g = p.add_argument_group("fault injection (off by default)")
    g.add_argument("--fault-error-rate", type=float, default=0.0,
                   help="fraction of requests answered with --fault-error-status")
    g.add_argument("--fault-error-status", type=int, default=503,
                   help="HTTP status of injected errors")
    g.add_argument("--fault-stall", type=float, default=0.0, help="seconds before first token")
    g.add_argument("--fault-stall-rate", type=float, default=1.0,
                   help="fraction of requests that --fault-stall delays")
    g.add_argument("--fault-drop-rate", type=float, default=0.0,
                   help="fraction of streams cut off mid-way")
    g.add_argument("--fault-drop-after", type=int, default=4,
                   help="tokens a dropped stream sends before it is cut")
    g.add_argument("--fault-slow-step", type=float, default=0.0, help="seconds added per step")
    add_log_args(p)


def backend_config(ns: argparse.Namespace) -> BackendConfig:
    engine = EngineConfig(
        max_num_seqs=ns.max_num_seqs, max_num_batched_tokens=ns.max_num_batched_tokens,
        block_size=ns.block_size, gpu_memory_utilization=ns.gpu_memory_utilization,
        num_gpu_blocks=ns.num_gpu_blocks, enable_prefix_caching=not ns.no_prefix_caching,
        time_scale=ns.time_scale, jitter=ns.jitter, seed=ns.seed,
        kv_hold_timeout_s=ns.kv_hold_timeout, max_loras=ns.max_loras if ns.enable_lora else 0,
        scheduling_policy=ns.scheduling_policy)
    faults = FaultConfig(
        error_rate=ns.fault_error_rate, error_status=ns.fault_error_status,
        stall_s=ns.fault_stall, stall_rate=ns.fault_stall_rate, drop_rate=ns.fault_drop_rate,
        drop_after_tokens=ns.fault_drop_after, slow_step_s=ns.fault_slow_step)
    link = ns.kv_link_gbps * 1e9 if ns.kv_link_gbps else KV_LINKS[ns.kv_link]
    for peer in ns.kv_peer or ():
        ipaddress.ip_network(peer, strict=False)  # a ValueError names a bad --kv-peer
    return BackendConfig(
        host=ns.host, port=ns.port, model=ns.model, tensor_parallel=ns.tensor_parallel,
        hardware=ns.hardware,
        served_model_name=ns.served_model_name, role=ns.role, profiles_file=ns.profiles,
        max_model_len=ns.max_model_len, image_tokens=ns.image_tokens,
        output_len=ns.output_len, kv_link_bps=link,
        load_bandwidth_bps=ns.load_bandwidth * 1e9, api_key=ns.api_key,
        kv_peers=tuple(ns.kv_peer) if ns.kv_peer else LOOPBACK_PEERS,
        max_body_bytes=int(ns.max_body_mb * 1024 * 1024), engine=engine, faults=faults,
        kv_events=_kv_events(ns.kv_events_config), tokenizer=ns.tokenizer,
        kv_offload_bytes=_offload(ns.kv_offload_gb), kv_pool_url=_pool_url(ns.kv_pool),
        kv_pool_token=_pool_token(ns.kv_pool, ns.kv_pool_token_env),
        pooling=_pooling(ns), lora=_lora(ns))


def _lora(ns: argparse.Namespace) -> LoraConfig | None:
    if not ns.enable_lora:
        if ns.lora_modules:
            raise ValueError("--lora-modules needs --enable-lora")
        return None
    if ns.max_loras <= 0 or ns.max_lora_rank <= 0:
        raise ValueError("--max-loras and --max-lora-rank must be positive")
    modules = []
    for item in ns.lora_modules or ():
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules {item!r}: expected NAME=PATH")
        modules.append((name, path))
    return LoraConfig(ns.max_loras, ns.max_lora_rank, tuple(modules))


def _pooling(ns: argparse.Namespace) -> PoolingConfig | None:
    if not ns.models:
        if ns.pooling not in (None, "dedicated"):
            raise ValueError(f"--pooling {ns.pooling} shares an instance among models: "
                             "name them with --models")
        return None
    if ns.served_model_name:
        raise ValueError("--models names the served models; drop --served-model-name")
    models: list[tuple[str, str]] = []
    for item in ns.models.split(","):
        name, _, profile = item.strip().partition("=")
        if not name:
            raise ValueError(f"--models {ns.models!r}: an empty model name")
        models.append((name, profile or name))
    mode: Mode = ns.pooling or ("token" if len(models) > 1 else "dedicated")
    if ns.slo_ttft <= 0 or ns.slo_tpot <= 0:
        raise ValueError("--slo-ttft and --slo-tpot must be positive")
    return PoolingConfig(tuple(models), mode,
                         SwitchCost(source=ns.weights_from, optimised=not ns.naive_switch),
                         ns.slo_ttft, ns.slo_tpot)


def _offload(gb: float) -> float:
    if gb < 0:
        raise ValueError("--kv-offload-gb must not be negative")
    return gb * 1e9


def _pool_url(url: str | None) -> str | None:
    if not url:
        return None
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.username \
            or parts.password or parts.path not in ("", "/") or parts.query:
        raise ValueError(f"--kv-pool {url!r}: expected http://HOST:PORT")
    return url.rstrip("/")


def _pool_token(url: str | None, env: str) -> str | None:
    if not url:
        return None
    token = os.environ.get(env, "")
    if not token:
        raise ValueError(f"--kv-pool needs the pool's token in {env}")
    return token


def _kv_events(raw: str | None) -> KVEventsConfig | None:
    if not raw:
        return None
    try:
        doc = json.loads(raw)
    except ValueError as exc:
        raise ValueError(f"--kv-events-config is not JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise ValueError("--kv-events-config must be a JSON object")
    return KVEventsConfig.from_json(doc)


def add_kvpool_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("kvpool", help="a KV block pool shared by backend instances "
                       "(Mooncake Store's role)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default loopback: instances elsewhere need "
                   "an address they can reach, and the token)")
    p.add_argument("--port", type=int, default=9600, help="port to listen on")
    p.add_argument("--capacity-gb", type=float, required=True, help="pool capacity in GB")
    p.add_argument("--token-env", default=KVPOOL_TOKEN_ENV, metavar="NAME",
                   help="the environment variable holding the shared secret backends send "
                   "(required, at least 16 characters)")
    p.add_argument("--kv-events-config", metavar="JSON",
                   help="publish the pool's KV events over ZMQ (vLLM's keys and format)")
    add_log_args(p)


def run_kvpool(ns: argparse.Namespace) -> int:
    from backend.kvpool import check_token, serve

    try:
        if not ns.capacity_gb > 0:
            raise ValueError("--capacity-gb must be positive")
        token = os.environ.get(ns.token_env, "")
        if not token:
            raise ValueError(f"set {ns.token_env} to the pool's shared secret (backends send "
                             "it from the same variable)")
        events = _kv_events(ns.kv_events_config)
        run_loop(serve(ns.host, ns.port, int(ns.capacity_gb * 1e9), events,
                       token=check_token(token), handle_signals=True))
    except (OSError, ValueError) as exc:  # a bad option, or an address already in use
        print(f"tokengate kvpool: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 0
    return 0


def run(ns: argparse.Namespace) -> int:
    from backend.process import serve
    from roofline.profiles import ProfileError

    try:
        config = backend_config(ns)
        config.faults.validate()
        run_loop(serve(config, handle_signals=True))
    except (OSError, ProfileError, ValueError) as exc:  # OSError: an address in use
        print(f"tokengate backend: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 0
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tokengate")
    add_parser(parser.add_subparsers(dest="command", required=True))
    ns = parser.parse_args(["backend", *(sys.argv[1:] if argv is None else argv)])
    logs.configure(ns.log_level, ns.log_format)
    return run(ns)


if __name__ == "__main__":
    sys.exit(main())
