"""What the inbound HTTP server costs: the same pass-through proxy (read the request, POST it
upstream with the gateway's own ``UpstreamClient``, return the answer) on each candidate
server, against vllm-router on the same upstreams, in one run, alternated over rounds
(granian is not a dependency: ``pip install granian`` to include it).

    python -m benchmarks.servers [--rounds 3] [--seconds 5] [--clients 16]

Servers: aiohttp's ``web`` (what ``tokengate serve`` runs on), a bare asyncio ``Protocol``
with llhttp (``httptools``) request parsing, and granian's RSGI (Rust HTTP, when
installed). Each is only the floor a gateway on that server can reach: no auth, no
counting, no routing, no limits. Reported per server: req/s (wrk when installed, else
``proxy_bench.python_load``) and the server process tree's CPU seconds per 1,000 requests
(``benchmarks.proxy``).

``python -m benchmarks.servers --serve KIND --port P --upstream URL ...`` runs one of
the proxies (the benchmark starts them so).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import itertools
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import httptools
import numpy as np

from benchmarks import common
from benchmarks import peer_stack as peers
from benchmarks.proxy import cpu_seconds, python_load, start_echo_upstreams, stop_all, wrk
from gateway.request.upstream import UpstreamClient
from loadtests.client import wait_for
from protocol.loopback import free_port

JSON = {"Content-Type": "application/json"}


def _aiohttp(port: int, ups: list[str]) -> None:
    from aiohttp import web

    client, rr = UpstreamClient(), itertools.cycle(ups)

    async def handle(request: web.Request) -> web.Response:
        body = await request.read()
        r = await client.post(f"{next(rr)}/v1/chat/completions", body, JSON,
                              connect_timeout_s=5)
        data = await r.read()
        r.release()
        return web.Response(body=data, content_type="application/json")

    app = web.Application()
    app.router.add_post("/v1/chat/completions", handle)
    web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None)


class _Proto(asyncio.Protocol):
    """HTTP/1.1 keep-alive, one request at a time, parsed by llhttp."""

    def __init__(self, client: UpstreamClient, rr: Any) -> None:
        self.client, self.rr = client, rr
        self.parser = httptools.HttpRequestParser(self)
        self.body: list[bytes] = []
        self.transport: asyncio.Transport | None = None
        self.task: asyncio.Future[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            if self.transport is not None:
                self.transport.write(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n"
                                     b"Connection: close\r\n\r\n")
                self.transport.close()

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        body, self.body = b"".join(self.body), []
        self.task = asyncio.ensure_future(self._forward(body))

    async def _forward(self, body: bytes) -> None:
        r = await self.client.post(f"{next(self.rr)}/v1/chat/completions", body, JSON,
                                   connect_timeout_s=5)
        data = await r.read()
        r.release()
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                                 b"Content-Length: %d\r\n\r\n" % len(data) + data)


def _raw(port: int, ups: list[str]) -> None:
    async def main() -> None:
        client, rr = UpstreamClient(), itertools.cycle(ups)
        loop = asyncio.get_running_loop()
        server = await loop.create_server(lambda: _Proto(client, rr), "127.0.0.1", port)
        await server.serve_forever()

    _run(main())


def _run(coro: Any) -> None:
    try:
        import uvloop

        uvloop.run(coro)
    except ImportError:  # pragma: no cover
        asyncio.run(coro)


def rsgi_app(ups: list[str]) -> Any:
    client, rr = UpstreamClient(), itertools.cycle(ups)

    async def app(scope: Any, proto: Any) -> None:
        body = await proto()
        r = await client.post(f"{next(rr)}/v1/chat/completions", body, JSON,
                              connect_timeout_s=5)
        data = await r.read()
        r.release()
        proto.response_bytes(200, [("content-type", "application/json")], data)
    return app


def _start(kind: str, ups: list[str], work: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    if kind == "granian":
        (work / "rsgi_target.py").write_text(
            "from benchmarks.servers import rsgi_app\n"
            f"app = rsgi_app({ups!r})\n")
        cmd = [sys.executable, "-m", "granian", "--interface", "rsgi", "--host", "127.0.0.1",
               "--port", str(port), "--workers", "1", "--loop", "uvloop", "--no-ws",
               "--log-level", "warning", "rsgi_target:app"]
        env_path = f"{work}:{Path(__file__).resolve().parent.parent}"
    else:
        cmd = [sys.executable, "-m", "benchmarks.servers", "--serve", kind, "--port",
               str(port), "--upstream", *ups]
        env_path = str(Path(__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": env_path}
    with open(work / f"{kind}.log", "wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
    return proc, f"http://127.0.0.1:{port}"


def _has_granian() -> bool:
    return importlib.util.find_spec("granian") is not None


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="bench-servers-"))
    procs: list[subprocess.Popen[bytes]] = []
    try:
        procs, ups = start_echo_upstreams(2)
        for u in ups:
            await wait_for(f"{u}/health")
        kinds = ["aiohttp", "raw-httptools"] + (["granian"] if _has_granian() else [])
        targets: dict[str, tuple[int, str]] = {}
        for kind in kinds:
            proc, base = _start(kind, ups, work)
            procs.append(proc)
            targets[kind] = (proc.pid, base)
        vr, vurl = peers.start_vllm_router(ups, work / "vllm-router.log")
        procs.append(vr)
        targets["vllm-router"] = (vr.pid, vurl.rsplit("/v1", 1)[0])
        for _, base in targets.values():
            await wait_for(f"{base}/v1/chat/completions", ok_below=500)
        rounds = []
        names = list(targets)
        for k in range(args.rounds):
            order = names[k % len(names):] + names[:k % len(names)]
            row = {}
            for name in order:
                pid, base = targets[name]
                c0 = cpu_seconds(pid)
                got = await asyncio.to_thread(wrk, f"{base}/v1", args.clients, args.seconds,
                                              work) if shutil.which("wrk") else \
                    await python_load(f"{base}/v1", args.clients, args.seconds)
                cpu = cpu_seconds(pid) - c0
                row[name] = {"rps": got.rps, "errors": got.errors,
                             "cpu_s_per_1000": cpu * 1000 / max(got.requests, 1)}
            rounds.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
        summary = {n: {"rps": float(np.median([r[n]["rps"] for r in rounds])),
                       "cpu_s_per_1000": float(np.median([r[n]["cpu_s_per_1000"]
                                                          for r in rounds]))}
                   for n in names}
        return {"when": common.when(),
                "clients": args.clients, "seconds": args.seconds, "rounds": rounds,
                "summary": summary}
    finally:
        stop_all(procs)


def main() -> None:
    p = common.parser(__doc__)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--serve", choices=("aiohttp", "raw-httptools"))
    p.add_argument("--port", type=int)
    p.add_argument("--upstream", nargs="*", default=[])
    a = p.parse_args()
    if a.serve == "aiohttp":
        _aiohttp(a.port, a.upstream)
    elif a.serve == "raw-httptools":
        _raw(a.port, a.upstream)
    else:
        common.show(asyncio.run(bench(a)))


if __name__ == "__main__":
    main()
