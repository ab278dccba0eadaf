"""tokengate side by side with the Rust routers (and LiteLLM) over the same zero-delay upstream.

    python -m benchmarks.peers [--rounds 3] [--requests 200] [--seconds 5]
        [--clients 16,64] [--litellm] [--workers N] [--quota-lease F] [--only NAMES]
        [--strace] [--out DIR]

Two echo upstreams (``loadtests.echo_upstream``: answers at once, 8 tokens) sit behind every
proxy: vllm-router 0.1.17 and sglang-router 0.3.2 with ``round_robin`` (installed from PyPI
into ``.venv-peers`` the first time, ``benchmarks.peer_stack``), LiteLLM's proxy with
``--litellm``, and tokengate ``serve`` in three configurations:

* ``tokengate-route``: routing only (``round_robin``, no limits, no Redis);
* ``tokengate-quota``: + the tenant's RPM/TPM leaky buckets in a real Redis (reserve and
  settle per request) and token counting;
* ``tokengate-predicted``: + ``predicted`` routing (features, prior and trees per decision).

Each round, in an order that rotates from round to round: one client sends the same chat
request to every target in turn (added latency over direct, p50/p99; then streaming, time to
the first content chunk), then each target alone takes keep-alive load at each ``--clients``
count for ``--seconds`` (wrk when installed, else a Python client whose own ceiling, its rate
against the upstream directly, is reported beside it), and the proxy's process tree's CPU
time over that load gives CPU seconds per 1,000 requests. Everything shares this machine's
cores, so read ratios within a round; every round is in the report (``report.json``,
``report.md``, ``peers.png``).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from benchmarks import common
from benchmarks import peer_stack as peers
from benchmarks.proxy import (
    KEY,
    Load,
    cpu_seconds,
    interleaved,
    percentiles_ms,
    python_load,
    start_echo_upstreams,
    stop_all,
    wrk,
)
from loadtests.client import wait_for
from protocol.loopback import free_port

TOKENGATE = {"tokengate-route": ("round_robin", False), "tokengate-quota": ("round_robin", True),
             "tokengate-predicted": ("predicted", True)}


class Stack:
    """The upstreams, Redis and every proxy, started once for all rounds."""

    def __init__(self, work: Path, litellm: bool, workers: int = 1,
                 only: set[str] | None = None, lease: float = 0.0) -> None:
        self.work = work
        self.lease = lease
        self.workers = workers
        self.only = only
        self.procs: list[subprocess.Popen[bytes]] = []
        self.targets: dict[str, str] = {}  # name -> /v1 base URL
        self.pids: dict[str, int] = {}
        self.litellm = litellm

    def _spawn(self, cmd: list[str], log: str) -> subprocess.Popen[bytes]:
        with open(self.work / log, "wb") as f:
            p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
        self.procs.append(p)
        return p

    async def start(self) -> None:
        procs, ups = start_echo_upstreams(2, self.work)
        self.procs += procs
        for u in ups:
            await wait_for(f"{u}/health")
        self.targets["direct"] = f"{ups[0]}/v1"
        rport = free_port()
        self._spawn(["redis-server", "--port", str(rport), "--save", "", "--appendonly", "no",
                     "--bind", "127.0.0.1"], "redis.log")
        for name, (strategy, quota) in TOKENGATE.items():
            if self.only is not None and name not in self.only:
                continue
            self._tokengate(name, ups, strategy, f"redis://127.0.0.1:{rport}/0" if quota
                            else None)
        for name, start in self._peers().items():
            if self.only is not None and name not in self.only:
                continue
            proc, url = start(ups, self.work / f"{name}.log")
            self.procs.append(proc)
            self.targets[name], self.pids[name] = url, proc.pid
        for name in [n for n in TOKENGATE if n in self.targets]:
            await wait_for(self.targets[name].rsplit("/v1", 1)[0] + "/health")

    def _peers(self) -> dict[str, Callable[[list[str], Path],
                                           tuple[subprocess.Popen[bytes], str]]]:
        out = {"vllm-router": lambda w, log: peers.start_vllm_router(w, log, "round_robin"),
               "sglang-router": lambda w, log: peers.start_sglang(w, log, "round_robin")}
        if self.litellm:
            out["litellm"] = lambda w, log: peers.start_litellm(w, log, KEY)
        return out

    def _tokengate(self, name: str, ups: list[str], strategy: str, redis: str | None) -> None:
        tenant: dict[str, Any] = {"keys": [{"sha256": hashlib.sha256(KEY.encode()).hexdigest()}]}
        if redis:
            tenant["limits"] = {"rpm": 1e9, "tpm": 1e12}
        policy = {"version": 1,
                  "models": {"m": {"endpoints": [{"url": f"{u}/v1"} for u in ups],
                                   "routing": {"strategy": strategy}}},
                  "tenants": {"t": tenant}, "routes": {"r": {"tenants": ["t"], "models": ["m"]}}}
        if redis:
            policy["settings"] = {"quota_lease": self.lease}
        path = self.work / f"{name}.yaml"
        path.write_text(yaml.safe_dump(policy))
        port = free_port()
        cmd = [sys.executable, "-m", "tokengate", "serve", "--policy", str(path), "--port",
               str(port), "--log-level", "warning", "--workers", str(self.workers)]
        if redis:
            cmd += ["--redis", redis]
        proc = self._spawn(cmd, f"{name}.log")
        self.targets[name], self.pids[name] = f"http://127.0.0.1:{port}/v1", proc.pid

    def stop(self) -> None:
        stop_all(self.procs)


async def load(stack: Stack, name: str, clients: int, seconds: float) -> dict[str, Any]:
    pid = stack.pids.get(name)
    c0 = cpu_seconds(pid) if pid else 0.0
    if shutil.which("wrk"):
        got: Load = await asyncio.to_thread(wrk, stack.targets[name], clients, seconds,
                                            stack.work)
    else:
        got = await python_load(stack.targets[name], clients, seconds)
    cpu = cpu_seconds(pid) - c0 if pid else None
    return {"rps": got.rps, "requests": got.requests, "errors": got.errors, "tool": got.tool,
            "cpu_s_per_1000": cpu * 1000.0 / got.requests if cpu is not None and got.requests
            else None}


async def round_(stack: Stack, k: int, args: argparse.Namespace) -> dict[str, Any]:
    names = list(stack.targets)
    proxies = names[1:]
    order = proxies[k % len(proxies):] + proxies[:k % len(proxies)]
    targets = {n: stack.targets[n] for n in ["direct", *order]}
    out: dict[str, Any] = {"round": k, "order": order}
    for stream in (False, True):
        lat = await interleaved(targets, args.requests, stream)
        d = percentiles_ms(lat["direct"])
        rows = {}
        for n in order:
            p = percentiles_ms(lat[n])
            rows[n] = {**p, "added_p50_ms": p["p50_ms"] - d["p50_ms"],
                       "added_p99_ms": p["p99_ms"] - d["p99_ms"]}
        out["stream" if stream else "plain"] = {"direct": d, "proxies": rows}
    for clients in args.clients:
        out[f"load_{clients}"] = {n: await load(stack, n, clients, args.seconds)
                                  for n in ["direct", *order]}
    return out


def _strace_table(path: Path) -> dict[str, int]:
    """``strace -c``'s summary: calls per system call."""
    calls: dict[str, int] = {}
    for line in path.read_text().splitlines():
        parts = line.split()
        if len(parts) in (5, 6) and parts[0].replace(".", "").isdigit() and parts[-1] != "total":
            calls[parts[-1]] = int(parts[3])
    return calls


def syscalls(stack: Stack, name: str, clients: int, seconds: float) -> dict[str, Any]:
    """System calls per request of one proxy under load, from ``strace -c -f`` attached for
    the run (tracing slows the proxy, so only the per-request counts are meaningful)."""
    out = stack.work / f"strace-{name}.txt"
    tracer = subprocess.Popen(["strace", "-c", "-f", "-q", "-o", str(out), "-p",
                               str(stack.pids[name])], stderr=subprocess.DEVNULL)
    time.sleep(1.0)
    got = wrk(stack.targets[name], clients, seconds, stack.work)
    tracer.send_signal(signal.SIGINT)
    tracer.wait(20)
    calls = _strace_table(out)
    n = max(got.requests, 1)
    top = sorted(calls.items(), key=lambda kv: -kv[1])[:6]
    return {"requests": got.requests, "per_request": sum(calls.values()) / n,
            "top": {k: v / n for k, v in top}}


def summary(rounds: list[dict[str, Any]], clients: list[int]) -> dict[str, dict[str, float]]:
    """Per proxy, the median over rounds of each figure (every round is in ``rounds``)."""
    names = rounds[0]["order"]
    out: dict[str, dict[str, float]] = {}
    for n in names:
        row: dict[str, float] = {}
        for part, key in (("plain", "added_p50_ms"), ("plain", "added_p99_ms"),
                          ("stream", "added_p50_ms")):
            row[f"{part}_{key}"] = float(np.median([r[part]["proxies"][n][key] for r in rounds]))
        for c in clients:
            row[f"rps_{c}"] = float(np.median([r[f"load_{c}"][n]["rps"] for r in rounds]))
            cpu = [r[f"load_{c}"][n]["cpu_s_per_1000"] for r in rounds]
            if all(x is not None for x in cpu):
                row[f"cpu_s_per_1000_{c}"] = float(np.median(cpu))
        out[n] = row
    return out


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="bench-peers-"))
    only = set(args.only.split(",")) if args.only else None
    stack = Stack(work, args.litellm, args.workers, only, args.quota_lease)
    try:
        await stack.start()
        rounds = []
        for k in range(args.rounds):
            rounds.append(await round_(stack, k, args))
            print(json.dumps(rounds[-1]), file=sys.stderr, flush=True)
        traced = {}
        if args.strace and shutil.which("strace") and shutil.which("wrk"):
            for name in [n for n in stack.targets if n != "direct"]:
                traced[name] = await asyncio.to_thread(syscalls, stack, name, 16, 3.0)
        return {"when": common.when(),
                "rounds": rounds, "summary": summary(rounds, args.clients), "syscalls": traced,
                "wrk": bool(shutil.which("wrk")), "requests": args.requests,
                "tokengate_workers": args.workers, "quota_lease": args.quota_lease,
                "seconds": args.seconds}
    finally:
        stack.stop()


def main() -> None:
    p = common.parser(__doc__)
    common.rounds(p, clients="16,64")
    p.add_argument("--litellm", action="store_true", help="also LiteLLM's proxy (slow)")
    p.add_argument("--workers", type=int, default=1, help="tokengate serve --workers")
    p.add_argument("--quota-lease", type=float, default=0.05,
                   help="settings.quota_lease of the configurations with quotas (the "
                   "default policy's; 0: every request reserved in Redis)")
    p.add_argument("--only", help="comma-separated proxies to run (default: all)")
    p.add_argument("--strace", action="store_true",
                   help="then count each proxy's system calls per request (strace -c -f)")
    p.add_argument("--out", default="out/bench-peers")
    args = p.parse_args()
    args.clients = [int(x) for x in args.clients.split(",")]
    rep = asyncio.run(main_async(args))
    from benchmarks.peers_report import write

    write(rep, Path(args.out))
    common.show(rep["summary"])


if __name__ == "__main__":
    main()
