"""Limiter accuracy: several gateway processes sharing one Redis and one tenant TPM limit.

    python -m benchmarks.limiter [--gateways 3] [--seconds 120] [--tpm 60000] [--lease F]

Each request costs exactly ``--prompt + --output`` tokens (token-id prompts, ``ignore_eos``
answers from an echo upstream whose usage matches), so reservation equals settlement. The
tenant is offered ``--overload`` times its limit, open loop, round-robin over the gateways. A
GCRA bucket with burst B and rate r admits at most ``B + r·T`` tokens in T seconds; the run
reports what was admitted against that bound, and Redis script calls per request.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from benchmarks import common
from benchmarks.proxy import stop_all
from loadtests.client import wait_for
from protocol.loopback import free_port

KEY = "limiter-bench"


def _evalsha_calls(port: int) -> int:
    out = subprocess.run(["redis-cli", "-p", str(port), "INFO", "commandstats"],
                         capture_output=True, text=True, check=True).stdout
    total = 0
    for line in out.splitlines():
        if line.startswith(("cmdstat_evalsha:", "cmdstat_eval:")):
            total += int(line.split("calls=")[1].split(",")[0])
    return total


def start(a: argparse.Namespace) -> tuple[list[subprocess.Popen[bytes]], int, int, list[int]]:
    """Echo upstream, Redis and the gateways; returns (processes, upstream, redis, gateways)."""
    work = Path(tempfile.mkdtemp(prefix="bench-limiter-"))
    procs: list[subprocess.Popen[bytes]] = []
    up, rport = free_port(), free_port()
    procs.append(subprocess.Popen([sys.executable, "-m", "loadtests.echo_upstream", "--port",
                                   str(up)]))
    procs.append(subprocess.Popen(["redis-server", "--port", str(rport), "--save", "",
                                   "--appendonly", "no", "--bind", "127.0.0.1"],
                                  stdout=subprocess.DEVNULL))
    policy = {"version": 1,
              "models": {"m": {"endpoints": [{"url": f"http://127.0.0.1:{up}/v1"}]}},
              "tenants": {"t": {"keys": [{"sha256": hashlib.sha256(KEY.encode()).hexdigest()}],
                                "limits": {"tpm": a.tpm}}},
              "routes": {"r": {"tenants": ["t"], "models": ["m"]}}}
    policy["settings"] = {"quota_lease": a.lease}
    (work / "p.yaml").write_text(yaml.safe_dump(policy))
    time.sleep(0.5)
    ports = [free_port() for _ in range(a.gateways)]
    for port in ports:
        procs.append(subprocess.Popen([sys.executable, "-m", "tokengate", "serve", "--policy",
                                       str(work / "p.yaml"), "--port", str(port), "--redis",
                                       f"redis://127.0.0.1:{rport}/0", "--log-level",
                                       "warning"]))
    return procs, up, rport, ports


async def run_load(a: argparse.Namespace, up: int, rport: int, ports: list[int]
                   ) -> dict[str, Any]:
    for port in ports:
        await wait_for(f"http://127.0.0.1:{port}/health")
    await wait_for(f"http://127.0.0.1:{up}/v1/models", ok_below=500)
    cost = a.prompt + a.output
    rate = a.overload * a.tpm / 60.0 / cost  # requests/s offered
    body = json.dumps({"model": "m", "prompt": list(range(a.prompt)),
                       "max_tokens": a.output, "ignore_eos": True})
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    calls0 = _evalsha_calls(rport)
    statuses: dict[int, int] = {}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        async def one(i: int) -> None:
            url = f"http://127.0.0.1:{ports[i % len(ports)]}/v1/completions"
            async with s.post(url, data=body, headers=headers) as r:
                await r.read()
                statuses[r.status] = statuses.get(r.status, 0) + 1

        start = time.perf_counter()
        tasks = []
        i = 0
        while (t := i / rate) < a.seconds:
            delay = start + t - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.ensure_future(one(i)))
            i += 1
        await asyncio.gather(*tasks)
        elapsed = i / rate  # the offered window
    calls = _evalsha_calls(rport) - calls0
    admitted = statuses.get(200, 0) * cost
    bound = a.tpm + a.tpm / 60.0 * elapsed  # burst + rate x window
    return {"gateways": a.gateways, "tpm": a.tpm, "quota_lease": a.lease, "window_s": elapsed,
            "offered_tokens": i * cost, "admitted_tokens": admitted,
            "bucket_bound_tokens": bound, "admitted_over_bound": admitted / bound,
            "statuses": statuses, "redis_script_calls_per_request": calls / max(i, 1),
            "redis_script_calls_per_admitted_request": calls / max(statuses.get(200, 0), 1)}


def main() -> None:
    p = common.parser(__doc__)
    p.add_argument("--gateways", type=int, default=3)
    p.add_argument("--seconds", type=float, default=120.0)
    p.add_argument("--tpm", type=float, default=60000.0)
    p.add_argument("--overload", type=float, default=5.0)
    p.add_argument("--prompt", type=int, default=92)
    p.add_argument("--output", type=int, default=8)
    p.add_argument("--lease", type=float, default=0.05,
                   help="settings.quota_lease: each gateway leases this fraction of the bucket "
                   "(the default policy's; 0: every request reserved in Redis)")
    a = p.parse_args()
    procs, up, rport, ports = start(a)
    try:
        report = asyncio.run(run_load(a, up, rport, ports))
    finally:
        stop_all(procs)
    common.show(report)


if __name__ == "__main__":
    main()
