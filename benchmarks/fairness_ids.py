"""What clients' fairness ids cost a gateway: one ``tokengate serve`` (fair flow control,
quotas and fair-share counters in a real Redis) in front of an echo upstream. Idle CPU and
``/health`` latency are measured, then a tenant sends ``--ids`` requests each with a new
``x-fairness-id`` (as a flooder rotating ids would), then idle CPU and ``/health`` are measured
again, with the shared fair-share hash's size in Redis.

    python -m benchmarks.fairness_ids [--ids 100000] [--clients 32] [--idle-s 10] [--out DIR]

Before sub-flows, every id became a field of the shared hash that every replica renewed and
read whole every 100 ms: 50,000 ids took an idle gateway from 3 % to 31 % of a core and
``/health`` from 6 ms to 835 ms mean.
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

from benchmarks.common import write
from benchmarks.proxy import body, cpu_seconds, echo_and_redis, percentiles_ms, stop_all
from loadtests.client import wait_for
from protocol.loopback import free_port

TENANT_KEY = "ids-bench-key"
ADMIN_KEY = "ids-bench-admin"


def policy(upstream: str) -> dict[str, Any]:
    return {"version": 1, "settings": {"flow_control": {"mode": "fair"},
                                       "spend": {"log": False},
                                       "admin_key_sha256": hashlib.sha256(
                                           ADMIN_KEY.encode()).hexdigest()},
            "models": {"m": {"endpoints": [{"url": upstream}]}},
            "tenants": {"flood": {"keys": [{"sha256": hashlib.sha256(
                TENANT_KEY.encode()).hexdigest()}], "limits": {"rpm": 1e9, "tpm": 1e12}}},
            "routes": {"r": {"tenants": ["flood"], "models": ["m"]}}}


async def idle(base: str, pid: int, seconds: float, probes: int) -> dict[str, Any]:
    """The gateway's CPU over ``seconds`` doing nothing, then ``probes`` ``/health`` calls."""
    c0, t0 = cpu_seconds(pid), time.perf_counter()
    await asyncio.sleep(seconds)
    cpu = (cpu_seconds(pid) - c0) / (time.perf_counter() - t0)
    lat = []
    async with aiohttp.ClientSession() as s:
        for _ in range(probes):
            t = time.perf_counter()
            async with s.get(f"{base}/health") as r:
                await r.read()
            lat.append(time.perf_counter() - t)
    return {"idle_cpu_fraction": cpu, "health": percentiles_ms(lat),
            "health_max_ms": max(lat) * 1e3}


async def rotate(base: str, n: int, clients: int) -> dict[str, Any]:
    data, done, errors = body(), 0, 0
    ids = iter(range(n))
    t0 = time.perf_counter()

    async def client(s: aiohttp.ClientSession) -> None:
        nonlocal done, errors
        for i in ids:
            h = {"Authorization": f"Bearer {TENANT_KEY}", "Content-Type": "application/json",
                 "x-fairness-id": f"id-{i}"}
            async with s.post(f"{base}/v1/chat/completions", data=data, headers=h) as r:
                await r.read()
                done += r.status == 200
                errors += r.status != 200

    async with aiohttp.ClientSession() as s:
        await asyncio.gather(*(client(s) for _ in range(clients)))
    return {"requests": done, "errors": errors, "rps": done / (time.perf_counter() - t0)}


def hash_fields(port: int) -> dict[str, int]:
    """Fields of every fair-share hash in Redis (what each replica reads every 100 ms)."""
    cli = ["redis-cli", "-p", str(port)]
    keys = subprocess.run([*cli, "--scan", "--pattern", "*vtc*"], capture_output=True,
                          text=True, check=True).stdout.split()
    return {k: int(subprocess.run([*cli, "HLEN", k], capture_output=True, text=True,
                                  check=True).stdout.strip()) for k in keys}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ids", type=int, default=100_000)
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--idle-s", type=float, default=10.0)
    ap.add_argument("--probes", type=int, default=500)
    ap.add_argument("--out", default="benchmarks/results/fairness-ids")
    ns = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="tokengate-ids-"))
    procs, up, rport = echo_and_redis()
    gw = free_port()
    (work / "policy.yaml").write_text(yaml.safe_dump(policy(f"http://127.0.0.1:{up}/v1")))
    time.sleep(0.5)
    redis_url = f"redis://127.0.0.1:{rport}/0"
    gateway = subprocess.Popen([sys.executable, "-m", "tokengate", "serve", "--policy",
                                str(work / "policy.yaml"), "--port", str(gw), "--log-level",
                                "warning", "--redis", redis_url])
    procs.append(gateway)
    base = f"http://127.0.0.1:{gw}"

    async def run() -> dict[str, Any]:
        await wait_for(base + "/health", timeout_s=60)
        before = await idle(base, gateway.pid, ns.idle_s, ns.probes)
        print(json.dumps({"before": before}), flush=True)
        load = await rotate(base, ns.ids, ns.clients)
        print(json.dumps({"rotating_ids": load}), flush=True)
        after = await idle(base, gateway.pid, ns.idle_s, ns.probes)
        print(json.dumps({"after": after}), flush=True)
        fields = hash_fields(rport)
        async with aiohttp.ClientSession() as s, s.get(
                f"{base}/admin/flow", headers={"Authorization": f"Bearer {ADMIN_KEY}"}) as resp:
            flows = (await resp.json()) if resp.status == 200 else None
        return {"ids": ns.ids, "before": before, "rotating_ids": load, "after": after,
                "shared_hash_fields": fields,
                "flows_total": flows["models"]["m"]["flows_total"] if flows else None,
                "added_idle_cpu_fraction": after["idle_cpu_fraction"]
                - before["idle_cpu_fraction"],
                "added_health_p99_ms": after["health"]["p99_ms"] - before["health"]["p99_ms"]}

    try:
        out = asyncio.run(run())
        print(json.dumps(out), flush=True)
        write(ns.out, out)
    finally:
        stop_all(procs)


if __name__ == "__main__":
    main()
