"""Can one tenant's huge request stall the gateway for everyone? One ``tokengate serve`` in
front of an echo upstream. A light tenant sends small chats one after another and ``/health``
is probed, first with nothing else going on (``quiet``), then (``heavy``) while a heavy tenant
(its own process: the client that times the others is not slowed by it) keeps ``--heavy``
huge requests in flight (3 MB embeddings inputs, chats of 180 messages of
16,000 characters: each counted, then served) and a tenant whose quota is 3,000 tokens a minute
sends a 3 MB embeddings input once a second (refused: how long that takes is reported).

    python -m benchmarks.stall [--seconds 10] [--heavy 10] [--via serve|epp] [--busy]
        [--out DIR]

``--busy`` adds a phase between the two (``busy``): no other tenant, but one process per core
spinning at the same priority, sending nothing. It shows what contention for the machine's
cores alone costs the light tenant's path (the clients, the gateway, Envoy and the upstream
share those cores), against what the heavy tenant's requests cost it. Each phase reports the
share of the machine's CPU time that was busy (``/proc/stat``).

``--via epp``: the same through Envoy with ``tokengate epp`` as its endpoint picker (the EPP
counts and admits; ``/health`` is the EPP's own).

Reports p50/p99/max of ``/health`` and of the light tenant's requests in both phases, the tiny
tenant's refusal times and statuses, and the heavy tenant's statuses.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import multiprocessing
import os
import random
import string
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import orjson
import yaml

from benchmarks.common import write
from benchmarks.proxy import stop_all
from gateway.epp.envoy import Envoy, epp_front
from loadtests.client import wait_for
from protocol.loopback import free_port

KEYS = {"light": "stall-light", "heavy": "stall-heavy", "tiny": "stall-tiny"}


def policy(upstream: str) -> dict[str, Any]:
    def tenant(name: str, tpm: float) -> dict[str, Any]:
        return {"keys": [{"sha256": hashlib.sha256(KEYS[name].encode()).hexdigest()}],
                "limits": {"tpm": tpm, "rpm": 1e6}}

    return {"version": 1, "settings": {"spend": {"log": False}},
            "models": {"m": {"endpoints": [{"url": upstream}], "max_context": 4_000_000}},
            "tenants": {"light": tenant("light", 1e9), "heavy": tenant("heavy", 1e12),
                        "tiny": tenant("tiny", 3_000)},
            "routes": {"r": {"tenants": list(KEYS), "models": ["m"]}}}


def text(n: int, rng: random.Random) -> str:
    """``n`` characters of words and digits (what a pasted document looks like to BPE)."""
    words = ["".join(rng.choices(string.ascii_lowercase + string.digits, k=rng.randint(2, 11)))
             for _ in range(2000)]
    out, size = [], 0
    while size < n:
        w = rng.choice(words)
        out.append(w)
        size += len(w) + 1
    return " ".join(out)[:n]


def bodies(rng: random.Random) -> list[tuple[str, bytes]]:
    big = text(3_000_000, rng)
    chat = {"model": "m", "max_tokens": 4,
            "messages": [{"role": "user", "content": big[i * 16_000:(i + 1) * 16_000]}
                         for i in range(180)]}
    return [("/v1/embeddings", orjson.dumps({"model": "m", "input": big})),
            ("/v1/embeddings", orjson.dumps({"model": "m", "input": [
                big[i * 15_000:(i + 1) * 15_000] for i in range(200)]})),
            ("/v1/chat/completions", orjson.dumps(chat))]


def stats(xs: list[float]) -> dict[str, float]:
    a = np.asarray(xs or [0.0]) * 1e3
    return {"n": len(xs), "p50_ms": float(np.percentile(a, 50)),
            "p99_ms": float(np.percentile(a, 99)), "max_ms": float(a.max())}


def _auth(who: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[who]}", "Content-Type": "application/json"}


async def _timed(s: aiohttp.ClientSession, url: str, data: bytes | None, who: str | None
                 ) -> tuple[float, int]:
    t = time.perf_counter()
    if data is None:
        async with s.get(url) as r:
            await r.read()
    else:
        async with s.post(url, data=data, headers=_auth(who or "light")) as r:
            await r.read()
    return time.perf_counter() - t, r.status


def _spin(go: Any) -> None:
    """A process that keeps one core busy until ``go`` is set, sending nothing."""
    while not go.is_set():
        for _ in range(200_000):
            pass


def _cpu_busy() -> tuple[float, float]:
    """(busy, total) CPU time of the whole machine so far, in ticks (``/proc/stat``)."""
    fields = [float(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields) - idle, sum(fields)


def _heavy_process(base: str, heavy: int, go: Any, done: Any) -> None:
    """The heavy tenant, in a process of its own: its 30 MB of bodies in flight must not
    slow the loop that times the others (the gateway is what is measured, not the client)."""
    big = bodies(random.Random(0))
    status: dict[str, int] = {}

    async def run() -> None:
        stop = asyncio.Event()

        async def one(s: aiohttp.ClientSession, i: int) -> None:
            while not stop.is_set():
                path, data = big[i % len(big)]
                _, st = await _timed(s, base + path, data, "heavy")
                status[str(st)] = status.get(str(st), 0) + 1

        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as s:
            done.put("ready")
            tasks = [asyncio.ensure_future(one(s, i)) for i in range(heavy)]
            await asyncio.get_running_loop().run_in_executor(None, go.wait)
            stop.set()
            await asyncio.gather(*tasks)

    asyncio.run(run())
    done.put(status)


async def phase(base: str, health_url: str, seconds: float, heavy: int,
                big: list[tuple[str, bytes]] | None, spin: int = 0) -> dict[str, Any]:
    stop = asyncio.Event()
    health: list[float] = []
    light: list[float] = []
    light_status: dict[str, int] = {}
    tiny: list[float] = []
    tiny_status: dict[str, int] = {}
    small = orjson.dumps({"model": "m", "max_tokens": 4,
                          "messages": [{"role": "user", "content": "Say hello."}]})

    async def probes(s: aiohttp.ClientSession) -> None:
        while not stop.is_set():
            dt, _ = await _timed(s, health_url, None, None)
            health.append(dt)
            await asyncio.sleep(0.02)

    async def lights(s: aiohttp.ClientSession) -> None:
        while not stop.is_set():
            dt, st = await _timed(s, base + "/v1/chat/completions", small, "light")
            light.append(dt)
            light_status[str(st)] = light_status.get(str(st), 0) + 1
            await asyncio.sleep(0.02)

    async def tinies(s: aiohttp.ClientSession) -> None:
        assert big is not None
        while not stop.is_set():
            dt, st = await _timed(s, base + big[0][0], big[0][1], "tiny")
            tiny.append(dt)
            tiny_status[str(st)] = tiny_status.get(str(st), 0) + 1
            await asyncio.sleep(1.0)

    ctx = multiprocessing.get_context("spawn")
    go, done = ctx.Event(), ctx.Queue()
    worker = None
    if big is not None:
        worker = ctx.Process(target=_heavy_process, args=(base, heavy, go, done))
        worker.start()
        await asyncio.get_running_loop().run_in_executor(None, done.get)  # "ready"
        await asyncio.sleep(1.0)  # the heavy requests in flight
    spinners = [ctx.Process(target=_spin, args=(go,)) for _ in range(spin)]
    for p in spinners:
        p.start()
    b0, t0 = _cpu_busy()
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as s:
        tasks = [asyncio.ensure_future(probes(s)), asyncio.ensure_future(lights(s))]
        if big is not None:
            tasks.append(asyncio.ensure_future(tinies(s)))
        await asyncio.sleep(seconds)
        stop.set()
        await asyncio.gather(*tasks)
    b1, t1 = _cpu_busy()
    out: dict[str, Any] = {"health": stats(health), "light": stats(light),
                           "light_status": light_status,
                           "machine_busy": (b1 - b0) / max(t1 - t0, 1.0)}
    if spinners:
        go.set()
        for p in spinners:
            p.join()
    if worker is not None:
        go.set()
        heavy_status = await asyncio.get_running_loop().run_in_executor(None, done.get)
        worker.join()
        out |= {"tiny_refusal": stats(tiny), "tiny_status": tiny_status,
                "heavy_status": heavy_status}
    return out


def start(via: str, work: Path, procs: list[Any], envoys: list[Envoy]) -> tuple[str, str]:
    """The gateway under test in front of one echo upstream: (API base, health URL)."""
    up = free_port()
    procs.append(subprocess.Popen([sys.executable, "-m", "loadtests.echo_upstream", "--port",
                                   str(up)]))
    (work / "policy.yaml").write_text(yaml.safe_dump(policy(f"http://127.0.0.1:{up}/v1")))
    tg = [sys.executable, "-m", "tokengate"]
    if via == "serve":
        gw = free_port()
        procs.append(subprocess.Popen([*tg, "serve", "--policy", str(work / "policy.yaml"),
                                       "--port", str(gw), "--log-level", "error"]))
        return f"http://127.0.0.1:{gw}", f"http://127.0.0.1:{gw}/health"
    grpc, http, listen, admin = free_port(), free_port(), free_port(), free_port()
    procs.append(subprocess.Popen([*tg, "epp", "--policy", str(work / "policy.yaml"),
                                   "--port", str(grpc), "--http-port", str(http),
                                   "--log-level", "error"]))
    envoy = Envoy(epp_front(admin_port=admin, listen_host="127.0.0.1", listen_port=listen,
                            epp_host="127.0.0.1", epp_port=grpc,
                            endpoints=[f"127.0.0.1:{up}"]), admin, work / "envoy.log")
    envoys.append(envoy)
    envoy.start()
    return f"http://127.0.0.1:{listen}", f"http://127.0.0.1:{http}/health"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--heavy", type=int, default=10, help="huge requests kept in flight")
    ap.add_argument("--via", choices=("serve", "epp"), default="serve")
    ap.add_argument("--busy", action="store_true",
                    help="also a phase with every core kept busy by a spinning process")
    ap.add_argument("--out", default="benchmarks/results/stall")
    ns = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="tokengate-stall-"))
    procs: list[Any] = []
    envoys: list[Envoy] = []
    big = bodies(random.Random(0))

    async def run() -> dict[str, Any]:
        base, health = start(ns.via, work, procs, envoys)
        await wait_for(health, timeout_s=60)
        quiet = await phase(base, health, ns.seconds, 0, None)
        print(json.dumps({"quiet": quiet}), flush=True)
        busy: dict[str, Any] = {}
        if ns.busy:
            busy = {"busy": await phase(base, health, ns.seconds, 0, None,
                                        spin=os.cpu_count() or 1)}
            print(json.dumps(busy), flush=True)
        heavy = await phase(base, health, ns.seconds, ns.heavy, big)
        print(json.dumps({"heavy": heavy}), flush=True)
        return {"via": ns.via, "seconds": ns.seconds, "heavy_in_flight": ns.heavy,
                "heavy_bodies_bytes": [len(b) for _, b in big], "quiet": quiet, **busy,
                "heavy": heavy}

    try:
        out = asyncio.run(run())
        write(ns.out, out)
    finally:
        for e in envoys:
            e.stop()
        stop_all(procs)


if __name__ == "__main__":
    main()
