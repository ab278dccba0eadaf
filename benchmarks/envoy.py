"""What tokengate as Envoy's Endpoint Picker costs, beside the other ways in front of the same
upstreams.

    python -m benchmarks.envoy [--rounds 3] [--requests 200] [--seconds 5]
        [--clients 16] [--out DIR]

Two echo upstreams (``loadtests.echo_upstream``: answers at once, 8 tokens); in front of
them, one policy (round robin, the tenant's RPM/TPM buckets in memory, token counting):

* ``direct``: the first upstream itself;
* ``serve``: ``tokengate serve``;
* ``envoy``: Envoy alone (``gateway/epp/configs/envoy-roundrobin.yaml``: no quota, no counting);
* ``envoy+epp``: Envoy with ``tokengate epp`` as its ext_proc endpoint picker
  (``gateway/epp/configs/envoy-epp.yaml``, FULL_DUPLEX_STREAMED both ways);
* ``envoy+floor``: the same Envoy with a picker that does nothing but the protocol
  (``benchmarks.ext_proc_floor --serve-relay``: each body given back unchanged at its end, on
  grpcio's asyncio server as ``tokengate epp`` runs): what the ext_proc exchange itself adds.

Each round, in an order that rotates: one client sends the same chat request to each target
in turn (added p50/p99 over direct; then streaming, to the first content chunk), then each
target takes ``--clients`` keep-alive connections for ``--seconds``; the CPU seconds per
1,000 requests of each process in the path (Envoy and the EPP separately) come from /proc.
Everything shares this machine's cores: read ratios within a round; every round is kept
(``report.json``)."""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from benchmarks import common
from benchmarks.proxy import (
    KEY,
    cpu_seconds,
    interleaved,
    percentiles_ms,
    python_load,
    start_echo_upstreams,
    stop_all,
)
from gateway.epp.envoy import Envoy, endpoints_yaml, render
from loadtests.client import wait_for
from protocol.loopback import free_port


class Stack:
    def __init__(self, work: Path) -> None:
        self.work = work
        self.procs: list[subprocess.Popen[bytes]] = []
        self.envoys: list[Envoy] = []
        self.targets: dict[str, str] = {}
        self.pids: dict[str, dict[str, int]] = {}  # target -> process name -> pid

    def _spawn(self, cmd: list[str], log: str) -> subprocess.Popen[bytes]:
        with open(self.work / log, "wb") as f:
            p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
        self.procs.append(p)
        return p

    def _envoy(self, config: str, admin: int) -> Envoy:
        e = Envoy(config, admin, self.work / f"envoy-{admin}.log")
        e.start()
        self.envoys.append(e)
        assert e.proc is not None
        return e

    async def start(self) -> None:
        procs, ups = start_echo_upstreams(2, self.work)
        self.procs += procs
        for u in ups:
            await wait_for(f"{u}/health")
        self.targets["direct"] = f"{ups[0]}/v1"
        policy = {"version": 1,
                  "models": {"m": {"endpoints": [{"url": f"{u}/v1"} for u in ups],
                                   "routing": {"strategy": "round_robin"}}},
                  "tenants": {"t": {"keys": [{"sha256": hashlib.sha256(KEY.encode())
                                              .hexdigest()}],
                                    "limits": {"rpm": 1e9, "tpm": 1e12}}},
                  "routes": {"r": {"tenants": ["t"], "models": ["m"]}}}
        path = self.work / "policy.yaml"
        path.write_text(yaml.safe_dump(policy))
        tg = [sys.executable, "-m", "tokengate"]
        port = free_port()
        serve = self._spawn([*tg, "serve", "--policy", str(path), "--port", str(port),
                             "--log-level", "warning"], "serve.log")
        self.targets["serve"], self.pids["serve"] = (f"http://127.0.0.1:{port}/v1",
                                                     {"serve": serve.pid})
        epp_port, http_port = free_port(), free_port()
        epp = self._spawn([*tg, "epp", "--policy", str(path), "--port", str(epp_port),
                           "--http-port", str(http_port), "--log-level", "warning"], "epp.log")
        floor_port = free_port()
        floor = self._spawn([sys.executable, "-m", "benchmarks.ext_proc_floor",
                             "--serve-relay", str(floor_port)], "floor.log")
        await wait_for(f"http://127.0.0.1:{port}/health")
        await wait_for(f"http://127.0.0.1:{http_port}/health")
        hostports = [(u.split("//")[1].split(":")[0], int(u.rsplit(":", 1)[1])) for u in ups]
        for name, file, extra in (
                ("envoy", "envoy-roundrobin.yaml", {"ENDPOINTS": endpoints_yaml(hostports)}),
                ("envoy+epp", "envoy-epp.yaml", {"EPP_HOST": "127.0.0.1",
                                                 "EPP_PORT": epp_port,
                                                 "ENDPOINTS": endpoints_yaml(hostports)}),
                ("envoy+floor", "envoy-epp.yaml", {"EPP_HOST": "127.0.0.1",
                                                   "EPP_PORT": floor_port,
                                                   "ENDPOINTS": endpoints_yaml(hostports)})):
            listen, admin = free_port(), free_port()
            e = self._envoy(render(file, ADMIN_PORT=admin, LISTEN_HOST="127.0.0.1",
                                   LISTEN_PORT=listen, **extra), admin)
            assert e.proc is not None
            self.targets[name] = f"http://127.0.0.1:{listen}/v1"
            self.pids[name] = {"envoy": e.proc.pid}
        self.pids["envoy+epp"]["epp"] = epp.pid
        self.pids["envoy+floor"]["epp"] = floor.pid

    def stop(self) -> None:
        for e in self.envoys:
            e.stop()
        stop_all(self.procs)


async def load(stack: Stack, name: str, clients: int, seconds: float) -> dict[str, Any]:
    pids = stack.pids.get(name, {})
    before = {k: cpu_seconds(p) for k, p in pids.items()}
    got = await python_load(stack.targets[name], clients, seconds)
    cpu = {k: (cpu_seconds(p) - before[k]) * 1000.0 / max(got.requests, 1)
           for k, p in pids.items()}
    return {"rps": got.rps, "requests": got.requests, "errors": got.errors, "tool": got.tool,
            "cpu_s_per_1000": cpu}


async def round_(stack: Stack, k: int, args: argparse.Namespace) -> dict[str, Any]:
    proxies = [n for n in stack.targets if n != "direct"]
    order = proxies[k % len(proxies):] + proxies[:k % len(proxies)]
    targets = {n: stack.targets[n] for n in ["direct", *order]}
    out: dict[str, Any] = {"round": k, "order": order}
    for stream in (False, True):
        lat = await interleaved(targets, args.requests, stream)
        d = percentiles_ms(lat["direct"])
        out["stream" if stream else "plain"] = {"direct": d, "proxies": {n: {
            **(p := percentiles_ms(lat[n])), "added_p50_ms": p["p50_ms"] - d["p50_ms"],
            "added_p99_ms": p["p99_ms"] - d["p99_ms"]} for n in order}}
    out[f"load_{args.clients}"] = {n: await load(stack, n, args.clients, args.seconds)
                                   for n in ["direct", *order]}
    return out


def summary(rounds: list[dict[str, Any]], clients: int) -> dict[str, dict[str, float]]:
    """Per target, the median over rounds of each figure."""
    out: dict[str, dict[str, float]] = {}
    for n in rounds[0]["order"]:
        row = {f"{part}_{key}": float(np.median([r[part]["proxies"][n][key] for r in rounds]))
               for part in ("plain", "stream") for key in ("added_p50_ms", "added_p99_ms")}
        loads = [r[f"load_{clients}"] for r in rounds]
        row[f"rps_{clients}"] = float(np.median([x[n]["rps"] for x in loads]))
        row[f"rps_{clients}_vs_direct"] = float(np.median([x[n]["rps"] / x["direct"]["rps"]
                                                           for x in loads]))
        for proc in loads[0][n]["cpu_s_per_1000"]:
            row[f"cpu_s_per_1000_{proc}"] = float(np.median(
                [x[n]["cpu_s_per_1000"][proc] for x in loads]))
        out[n] = row
    return out


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    stack = Stack(Path(tempfile.mkdtemp(prefix="bench-envoy-")))
    try:
        await stack.start()
        rounds = []
        for k in range(args.rounds):
            rounds.append(await round_(stack, k, args))
            print(json.dumps(rounds[-1]), file=sys.stderr, flush=True)
        return {"when": common.when(), "rounds": rounds,
                "summary": summary(rounds, args.clients), "requests": args.requests,
                "seconds": args.seconds, "clients": args.clients}
    finally:
        stack.stop()


def main() -> None:
    p = common.parser(__doc__)
    common.rounds(p, clients=16)
    p.add_argument("--out", default="out/bench-envoy")
    args = p.parse_args()
    rep = asyncio.run(main_async(args))
    common.write(args.out, rep)
    common.show(rep["summary"])


if __name__ == "__main__":
    main()
