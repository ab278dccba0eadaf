"""CPU per request of each stage of the request path (``make bench-path``).

    python -m benchmarks.path [--seconds 3] [--rounds 2] [--payloads tiny,12k-warm,...]
        [--baseline TREE] [--fronts serve,epp] [--clients 4] [--check FILE] [--out DIR]

One ``tokengate serve`` (a real process) with every feature of the default policy on: the
tenant's RPM/TPM buckets in a real Redis, token counting, the spend record (its log line on),
flow control in ``fair``; one echo upstream that answers at once (``loadtests.echo_upstream``).
For each payload (a tiny chat, a warm 12K-token agent turn, a cold 100K-token one — each
streamed and not), a load of ``--clients`` concurrent clients runs for ``--seconds`` twice:

* unobserved, the CPU time of the gateway's process over the window (``/proc``) divided by the
  requests answered gives its CPU per request, and the echo upstream's the same for the
  *direct path* (an aiohttp server answering the same requests), the unit every stage is
  also given in, so that the machine's speed cancels;
* under ``py-spy`` (sampling the gateway's stacks, idle excluded), each sample is put in one
  stage by its stack (``benchmarks.path_stages``); a stage's CPU per request is its share of
  the samples times the unobserved CPU per request.

``--fronts serve,epp`` also runs ``tokengate epp`` behind Envoy (its ext_proc endpoint picker,
``envoy-epp.yaml``) with the same policy: the EPP's stages, and Envoy's CPU beside them.
``--baseline TREE`` runs a second checkout (``git worktree add /tmp/old REV``) the same way,
alternating with this one round by round: old and new side by side in one run. ``--check
FILE`` compares each stage, as a ratio to the direct path, with the budget in FILE and exits 1
when one is over twice its budget by more than 5 % of the request's CPU (a gross regression,
not noise); ``--write-budget FILE`` writes this run's figures as the budget.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from benchmarks import common
from benchmarks.path_report import check, ratios, table
from benchmarks.path_stages import STAGES, shares
from benchmarks.proxy import KEY, cpu_seconds, echo_and_redis, stop_all
from loadtests.client import wait_for
from protocol.loopback import free_port


@dataclass(frozen=True, slots=True)
class Payload:
    name: str
    stream: bool
    tokens: int  # about how many prompt tokens
    cold: bool  # a new prompt each request (nothing cached), else the same one


PAYLOADS = {p.name: p for p in (
    Payload("tiny", False, 8, False), Payload("tiny-stream", True, 8, False),
    Payload("12k-warm", False, 12_000, False), Payload("12k-warm-stream", True, 12_000, False),
    Payload("100k-cold", False, 100_000, True),
    Payload("100k-cold-stream", True, 100_000, True))}
WORDS = ["the", "gateway", "counts", "every", "token", "of", "an", "agent's", "turn",
         "before", "engine", "sees", "it", "and", "settles", "what", "was", "served",
         "against", "reserved"]


def _text(tokens: int, rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(tokens))


class Bodies:
    """Request bodies of one payload: the same bytes each time (warm) or a new prompt."""

    def __init__(self, p: Payload) -> None:
        self.p = p
        self.rng = random.Random(1)
        turns = max(1, p.tokens // 1000)
        self.messages = [{"role": "system", "content": "You are a coding agent."}] + [
            {"role": "user" if i % 2 == 0 else "assistant",
             "content": _text(p.tokens // turns, self.rng)} for i in range(turns)]
        self.fixed = self._encode(self.messages)

    def _encode(self, messages: list[dict[str, str]]) -> bytes:
        body: dict[str, Any] = {"model": "m", "messages": messages, "max_tokens": 8}
        if self.p.stream:
            body["stream"] = True
        return json.dumps(body).encode()

    def next(self) -> bytes:
        if not self.p.cold:
            return self.fixed
        salt = f"session {self.rng.getrandbits(64):x}: "
        first = dict(self.messages[1], content=salt + self.messages[1]["content"])
        return self._encode([self.messages[0], first, *self.messages[2:]])


async def load(url: str, bodies: Bodies, seconds: float, clients: int) -> int:
    """Requests answered 200 in ``seconds`` by ``clients`` keep-alive clients."""
    done = 0
    failed = 0
    stop = time.perf_counter() + seconds
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}

    async def one(session: aiohttp.ClientSession) -> None:
        nonlocal done, failed
        while time.perf_counter() < stop:
            async with session.post(url, data=bodies.next(), headers=headers) as r:
                await r.read()
                if r.status == 200:
                    done += 1
                else:
                    failed += 1
                    if failed == 1:
                        print(f"  a request failed: {r.status} {(await r.text())[:200]}",
                              file=sys.stderr)

    conn = aiohttp.TCPConnector(limit=clients)
    async with aiohttp.ClientSession(connector=conn) as session:
        await asyncio.gather(*(one(session) for _ in range(clients)))
    return done


class Gateway:
    """``tokengate serve`` from a source tree, with the default policy's features on; or,
    with ``front="epp"``, ``tokengate epp`` behind Envoy (its ext_proc endpoint picker): the
    process measured is then the EPP, and Envoy's CPU is reported beside it."""

    def __init__(self, tree: Path, work: Path, upstream: str, redis_port: int, tag: str,
                 front: str = "serve") -> None:
        policy = {
            "version": 1,
            "models": {"m": {"endpoints": [{"url": f"{upstream}/v1"}], "max_context": 131072}},
            "tenants": {"t": {"keys": [{"sha256": hashlib.sha256(KEY.encode()).hexdigest(),
                                        "name": "bench"}],
                              "limits": {"rpm": 1e9, "tpm": 1e12}}},
            "routes": {"r": {"tenants": ["t"], "models": ["m"]}},
            "settings": {"flow_control": {"mode": "fair"}, "spend": {"log": True}}}
        path = work / f"policy-{tag}-{front}.yaml"
        path.write_text(yaml.safe_dump(policy))
        self.port = free_port()
        env = dict(os.environ, PYTHONPATH=str(tree))
        self.log = open(work / f"{front}-{tag}.log", "wb")  # noqa: SIM115 - closed in stop
        cmd = [sys.executable, "-m", "tokengate", front, "--policy", str(path), "--port",
               str(self.port), "--redis", f"redis://127.0.0.1:{redis_port}/0"]
        self.health = f"http://127.0.0.1:{self.port}/health"
        if front == "epp":
            http = free_port()
            cmd += ["--http-port", str(http)]
            self.health = f"http://127.0.0.1:{http}/health"
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env,
                                     cwd=tree)
        self.url = f"http://127.0.0.1:{self.port}/v1/chat/completions"
        self.envoy: Any = None
        if front == "epp":
            from gateway.epp.envoy import Envoy, epp_front

            listen, admin = free_port(), free_port()
            self.envoy = Envoy(epp_front(admin_port=admin, listen_host="127.0.0.1",
                                         listen_port=listen, epp_host="127.0.0.1",
                                         epp_port=self.port,
                                         endpoints=[upstream.split("//", 1)[1]]), admin,
                               work / f"envoy-{tag}.log")
            self.url = f"http://127.0.0.1:{listen}/v1/chat/completions"

    async def ready(self) -> None:
        await wait_for(self.health)
        if self.envoy is not None:
            await asyncio.to_thread(self.envoy.start)

    def beside_pid(self) -> int | None:
        """Envoy's process, whose CPU is reported beside the EPP's."""
        return self.envoy.proc.pid if self.envoy is not None else None

    def stop(self) -> None:
        if self.envoy is not None:
            self.envoy.stop()
        self.proc.terminate()
        self.proc.wait(timeout=30)
        self.log.close()


def _spy(pid: int, seconds: int, out: Path) -> subprocess.Popen[bytes]:
    """py-spy sampling ``pid``'s threads (500 Hz, without pausing it) for ``seconds``."""
    return subprocess.Popen([shutil.which("py-spy") or "py-spy", "record", "--pid", str(pid),
                             "--rate", "500", "--format", "raw", "--nonblocking", "--duration",
                             str(seconds), "--output", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


async def measure(gw: Gateway, upstream_pid: int, p: Payload, seconds: float, clients: int,
                  work: Path) -> dict[str, Any]:
    """One payload on one gateway: the unobserved window, then the sampled one."""
    bodies = Bodies(p)
    await load(gw.url, bodies, min(1.0, seconds), clients)  # warm-up (and caches, if warm)
    beside = gw.beside_pid()
    g0, u0 = cpu_seconds(gw.proc.pid), cpu_seconds(upstream_pid)
    e0 = cpu_seconds(beside) if beside else 0.0
    n = await load(gw.url, bodies, seconds, clients)
    g1, u1 = cpu_seconds(gw.proc.pid), cpu_seconds(upstream_pid)
    e1 = cpu_seconds(beside) if beside else 0.0
    out = work / "profile.txt"
    spy = _spy(gw.proc.pid, max(1, round(seconds)), out)
    await asyncio.sleep(0.3)
    await load(gw.url, bodies, max(1, round(seconds)) - 0.5, clients)
    _, err = spy.communicate(timeout=60)
    share: dict[str, float]
    samples: int
    if spy.returncode != 0 or not out.exists():  # no ptrace here: the total alone
        print(f"  py-spy could not sample the gateway ({err.decode().strip()[-200:]}): "
              "stages not measured, only the total", file=sys.stderr)
        share, samples = {}, 0
    else:
        share, samples = shares(out.read_text())
    if os.environ.get("BENCH_PATH_KEEP"):
        shutil.copy(out, Path(os.environ["BENCH_PATH_KEEP"]) / f"{p.name}-{gw.port}.txt")
    per = (g1 - g0) / max(n, 1) * 1e6
    direct = (u1 - u0) / max(n, 1) * 1e6
    return {"requests": n, "cpu_us": per, "direct_us": direct, "samples": samples,
            "stages_us": {s: share[s] * per for s in STAGES} if share else {},
            "envoy_us": (e1 - e0) / max(n, 1) * 1e6 if beside else None}


async def run(args: argparse.Namespace) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="bench-path-"))
    procs, up_port, redis_port = echo_and_redis()
    upstream = f"http://127.0.0.1:{up_port}"
    trees: dict[str, Path] = args.trees
    gws = {f"{tag}" if front == "serve" else f"{tag} {front}":
           Gateway(tree, work, upstream, redis_port, tag, front)
           for tag, tree in trees.items() for front in args.fronts}
    result: dict[str, Any] = {"when": common.when(), "seconds": args.seconds,
                              "clients": args.clients, "rounds": []}
    try:
        await wait_for(f"{upstream}/health")
        for gw in gws.values():
            await gw.ready()
        order = list(gws)
        for r in range(args.rounds):
            row: dict[str, Any] = {}
            for name in args.payloads:
                for tag in order if r % 2 == 0 else reversed(order):
                    got = await measure(gws[tag], procs[0].pid, PAYLOADS[name], args.seconds,
                                        args.clients, work)
                    row.setdefault(name, {})[tag] = got
                    print(f"round {r + 1} {name:17} {tag}: {got['cpu_us']:8.0f} µs CPU/request "
                          f"({got['cpu_us'] / max(got['direct_us'], 1e-9):.1f}× direct, "
                          f"{got['requests']} requests, {got['samples']} samples)", flush=True)
            result["rounds"].append(row)
    finally:
        for gw in gws.values():
            gw.stop()
        stop_all(procs)
        shutil.rmtree(work, ignore_errors=True)
    return result


def main() -> None:
    p = common.parser(__doc__, "path")
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--payloads", default=",".join(PAYLOADS))
    p.add_argument("--baseline", default=None, help="another source tree, run alternately")
    p.add_argument("--fronts", default="serve",
                   help="serve, epp (behind Envoy), or both: serve,epp")
    p.add_argument("--check", default=None, help="a budget file: exit 1 on a gross regression")
    p.add_argument("--write-budget", default=None)
    args = p.parse_args()
    args.payloads = [x for x in args.payloads.split(",") if x]
    args.fronts = [x for x in args.fronts.split(",") if x]
    if not args.fronts or set(args.fronts) - {"serve", "epp"}:
        p.error("--fronts takes serve, epp or serve,epp")
    args.trees = {"new": Path.cwd()}
    if args.baseline:
        args.trees = {"old": Path(args.baseline).resolve(), "new": Path.cwd()}
    result = asyncio.run(run(args))
    print(table(result))
    if args.out:
        common.write(args.out, result)
        (Path(args.out) / "report.md").write_text(table(result) + "\n")
    if args.write_budget:
        Path(args.write_budget).write_text(json.dumps(ratios(result), indent=1) + "\n")
    if args.check:
        budget = json.loads(Path(args.check).read_text())
        print("\n| payload | stage | CPU / direct | budget |\n|---|---|---:|---:|")
        for name, per in ratios(result).items():
            for s, got in per.items():
                if got or budget.get(name, {}).get(s):
                    print(f"| {name} | {s} | {got:.2f} | {budget.get(name, {}).get(s, 0):.2f} |")
        over = check(result, budget)
        for line in over:
            print(f"over budget: {line}", file=sys.stderr)
        if over:
            raise SystemExit(1)


if __name__ == "__main__":
    main()
