"""Measuring proxies side by side: one client interleaved over several targets (latency, time
to first chunk), keep-alive load from wrk or a Python client (requests per second), and the
CPU time a process tree spent (utime + stime from ``/proc``, its descendants included).

Every target gets the same request: a short non-streaming (or streaming) chat completion of
8 tokens, with a bearer key the gateways check and the routers pass through.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import numpy as np

from protocol.loopback import free_port

# one bearer key for every target: the gateways check it (LiteLLM's proxy refuses to start
# with a weak master key, so it is a long one), the routers pass it through
KEY = "sk-tokengate-bench-3f9a1c7e5b2d4068a1b3c5d7e9f02468"
HEADERS = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}


def body(stream: bool = False) -> str:
    doc: dict[str, object] = {"model": "m", "max_tokens": 8, "messages": [
        {"role": "user", "content": "Say hello to the gateway."}]}
    if stream:
        doc["stream"] = True
    return json.dumps(doc)


def cpu_seconds(pid: int) -> float:
    """utime + stime of ``pid`` and every live descendant (a gateway's workers)."""
    parents: dict[int, int] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                parents[int(d.name)] = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    tree, frontier = {pid}, [pid]
    while frontier:
        p = frontier.pop()
        for child, parent in parents.items():
            if parent == p and child not in tree:
                tree.add(child)
                frontier.append(child)
    total = 0.0
    for p in tree:
        try:
            f = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")
    return total


async def _one(s: aiohttp.ClientSession, base: str, data: str, stream: bool,
               headers: Mapping[str, str] = HEADERS) -> float:
    """Seconds to the whole answer, or (streaming) to the first content chunk."""
    t = time.perf_counter()
    async with s.post(f"{base}/chat/completions", data=data, headers=headers) as r:
        if r.status != 200:
            raise RuntimeError(f"{base}: HTTP {r.status}: {(await r.text())[:200]}")
        if not stream:
            await r.read()
            return time.perf_counter() - t
        first = None
        async for line in r.content:
            if first is None and line.startswith(b"data: {") and b'"content"' in line:
                first = time.perf_counter() - t
        if first is None:
            raise RuntimeError(f"{base}: a stream without content")
        return first


async def interleaved(targets: Mapping[str, str], n: int, stream: bool, warmup: int = 50,
                      headers: Mapping[str, Mapping[str, str]] | None = None
                      ) -> dict[str, list[float]]:
    """One client: request i goes to every target in turn (so drift hits all alike), with
    the target's ``headers`` (default: the bench key's)."""
    data = body(stream)
    out: dict[str, list[float]] = {k: [] for k in targets}
    async with aiohttp.ClientSession() as s:
        for i in range(warmup + n):
            for name, base in targets.items():
                dt = await _one(s, base, data, stream, (headers or {}).get(name, HEADERS))
                if i >= warmup:
                    out[name].append(dt)
    return out


def percentiles_ms(xs: list[float]) -> dict[str, float]:
    a = np.asarray(xs) * 1e3
    return {"p50_ms": float(np.percentile(a, 50)), "p99_ms": float(np.percentile(a, 99))}


@dataclass(frozen=True, slots=True)
class Load:
    rps: float
    requests: int
    errors: int
    tool: str


def wrk(url: str, clients: int, seconds: float, workdir: Path) -> Load:
    script = workdir / "post.lua"
    script.write_text('wrk.method = "POST"\nwrk.body = [[' + body() + ']]\n'
                      + "".join(f'wrk.headers["{k}"] = "{v}"\n' for k, v in HEADERS.items()))
    r = subprocess.run(["wrk", "-t2", f"-c{clients}", f"-d{int(seconds)}s", "-s", str(script),
                        f"{url}/chat/completions"], capture_output=True, text=True, check=True)
    rate = re.search(r"Requests/sec:\s+([\d.]+)", r.stdout)
    total = re.search(r"(\d+) requests in", r.stdout)
    bad = re.search(r"Non-2xx or 3xx responses: (\d+)", r.stdout)
    sock = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)",
                     r.stdout)
    errors = int(bad.group(1)) if bad else 0
    if sock:
        errors += sum(int(g) for g in sock.groups())
    return Load(float(rate.group(1)) if rate else 0.0, int(total.group(1)) if total else 0,
                errors, f"wrk -t2 -c{clients}")


async def python_load(url: str, clients: int, seconds: float) -> Load:
    """``clients`` keep-alive connections, each sending back to back, for ``seconds``."""
    data = body()
    done = errors = 0
    end = time.perf_counter() + seconds
    conn = aiohttp.TCPConnector(limit=clients)
    async with aiohttp.ClientSession(connector=conn) as s:
        async def worker() -> None:
            nonlocal done, errors
            while time.perf_counter() < end:
                async with s.post(f"{url}/chat/completions", data=data, headers=HEADERS) as r:
                    await r.read()
                    if r.status == 200:
                        done += 1
                    else:
                        errors += 1
        await asyncio.gather(*(worker() for _ in range(clients)))
    return Load(done / seconds, done, errors, f"python aiohttp, {clients} connections")


def start_echo_upstreams(n: int, logs: Path | None = None
                         ) -> tuple[list[subprocess.Popen[bytes]], list[str]]:
    """``n`` echo upstreams (``loadtests.echo_upstream``) on free loopback ports: the
    processes and their base URLs (without /v1); output to ``logs/upstream-i.log`` if given."""
    procs, urls = [], []
    for i in range(n):
        port = free_port()
        cmd = [sys.executable, "-m", "loadtests.echo_upstream", "--port", str(port),
               "--chunks", "8"]
        if logs is None:
            procs.append(subprocess.Popen(cmd))
        else:
            with open(logs / f"upstream-{i}.log", "wb") as f:
                procs.append(subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT))
        urls.append(f"http://127.0.0.1:{port}")
    return procs, urls


def echo_and_redis() -> tuple[list[subprocess.Popen[bytes]], int, int]:
    """An echo upstream (8 chunks per answer) and a redis-server of its own, on free loopback
    ports: the processes, the upstream's port and Redis's."""
    up, rport = free_port(), free_port()
    procs = [subprocess.Popen([sys.executable, "-m", "loadtests.echo_upstream", "--port",
                               str(up), "--chunks", "8"]),
             subprocess.Popen(["redis-server", "--port", str(rport), "--save", "",
                               "--appendonly", "no", "--bind", "127.0.0.1"],
                              stdout=subprocess.DEVNULL)]
    return procs, up, rport


def stop_all(procs: list[subprocess.Popen[bytes]], timeout_s: float = 10.0) -> None:
    """SIGTERM to every process, then wait for each (killed after ``timeout_s``)."""
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(timeout_s)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
