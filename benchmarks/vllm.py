"""tokengate in front of two real vLLM instances (``make vllm``): routing strategies side by
side, the precise index against the engines' own events, and the cost of tracing.

``python -m benchmarks.vllm [--rounds 2] [--docs 6] [--questions 4] [--agreement 200]``

1. *Routing*: a workload of ``docs`` documents (~1,200 tokens each, new to the engines every
   run) each asked ``questions`` follow-ups, interleaved, one client, streamed. Strategies
   ``round_robin``, ``prefix`` + approximate index and ``prefix`` + precise index run in
   alternating order for ``rounds`` rounds, each through a fresh gateway process; the prefix
   hit rate is vLLM's own (``vllm:prefix_cache_hits_total`` / ``queries_total`` deltas, both
   instances), TTFT is the client's.
2. *Agreement*: ``agreement`` mixed requests (documents, questions, chat, one-off prompts)
   through a precise gateway, then per engine the gateway's index size against the blocks the
   engine's replay socket says it holds.
3. *Tracing*: one client alternating direct / gateway (tracing off) / gateway (tracing on, to a
   real OTLP receiver) requests; each gateway's added p50 over direct.

Every run is printed, not the best; ratios are within one run.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import httpx
import yaml

from benchmarks import common
from engines import vllm
from loadtests.otlp_receiver import OTLPReceiver
from protocol.loopback import free_port

KEY = "bench-key"
ADMIN = "bench-admin"
DOC = "Document {tag}. " + "The quick brown fox jumps over the lazy dog and keeps running. " * 100


def _metric(url: str, name: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
        text = r.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


def _policy(specs: list[vllm.VllmSpec], model: Path, routing: dict[str, Any],
            tracing: str | None = None) -> dict[str, Any]:
    settings: dict[str, Any] = {"admin_key_sha256": hashlib.sha256(ADMIN.encode()).hexdigest()}
    if tracing:
        settings["tracing"] = {"otlp_endpoint": tracing}
    eps = []
    for s in specs:
        ev = s.kv_events
        assert ev is not None
        eps.append({"url": s.url + "/v1", "kv_events": {"endpoint": ev["endpoint"],
                                                         "replay": ev["replay"], "topic": "kv"}})
    return {"version": 1, "settings": settings,
            "models": {"tiny": {"endpoints": eps, "tokenizer": str(model),
                                "routing": routing}},
            "tenants": {"b": {"keys": [{"sha256": hashlib.sha256(KEY.encode()).hexdigest()}]}},
            "routes": {"r": {"tenants": ["b"], "models": ["tiny"]}}}


class Gateway:
    def __init__(self, doc: dict[str, Any], log: Path) -> None:
        self.port = free_port()
        fd, path = tempfile.mkstemp(suffix=".yaml")
        os.close(fd)
        Path(path).write_text(yaml.safe_dump(doc))
        self.policy = path
        self._log = open(log, "ab")  # noqa: SIM115 - the child's output, closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tokengate", "serve", "--policy", path, "--port",
             str(self.port), "--log-level", "warning"], stdout=self._log, stderr=self._log)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.1)
        raise RuntimeError("gateway did not start")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def endpoints(self) -> list[dict[str, Any]]:
        r = httpx.get(self.url + "/admin/endpoints",
                      headers={"Authorization": f"Bearer {ADMIN}"})
        return r.json()["tiny"]["endpoints"]  # type: ignore[no-any-return]

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)
        self._log.close()
        Path(self.policy).unlink(missing_ok=True)


def _ttft(client: httpx.Client, base: str, body: dict[str, Any]) -> float:
    t0 = time.perf_counter()
    with client.stream("POST", base + "/v1/completions", json={**body, "stream": True},
                       headers={"Authorization": f"Bearer {KEY}"}, timeout=120) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code}: {r.read()[:200]!r}")
        first = None
        for line in r.iter_lines():
            if first is None and line.startswith("data: {"):
                first = time.perf_counter() - t0
        assert first is not None
        return first * 1e3


def routing_run(specs: list[vllm.VllmSpec], model: Path, name: str, routing: dict[str, Any],
                docs: int, questions: int, seed: int, logs: Path) -> dict[str, Any]:
    gw = Gateway(_policy(specs, model, routing), logs / f"gateway-{name}.log")
    try:
        tag = f"{name}-{seed}-{time.time_ns()}"
        work = [(d, q) for d in range(docs) for q in range(questions + 1)]
        random.Random(seed).shuffle(work)
        work.sort(key=lambda x: x[1] > 0)  # every document is first read once, then asked
        before = [(_metric(s.url, "vllm:prefix_cache_queries_total"),
                   _metric(s.url, "vllm:prefix_cache_hits_total")) for s in specs]
        ttfts = []
        with httpx.Client() as c:
            for d, q in work:
                prompt = DOC.format(tag=f"{tag}-{d}") + (f" Question {q}: why?" if q else "")
                ttfts.append(_ttft(c, gw.url, {"model": "tiny", "prompt": prompt,
                                               "max_tokens": 4}))
                if routing.get("index") == "precise":
                    time.sleep(0.05)  # the engine's events travel while a client thinks
        after = [(_metric(s.url, "vllm:prefix_cache_queries_total"),
                  _metric(s.url, "vllm:prefix_cache_hits_total")) for s in specs]
        queries = sum(a[0] - b[0] for a, b in zip(after, before, strict=True))
        hits = sum(a[1] - b[1] for a, b in zip(after, before, strict=True))
        return {"strategy": name, "requests": len(work), "hit_rate": round(hits / queries, 4),
                "ttft_p50_ms": round(statistics.median(ttfts), 1),
                "ttft_p90_ms": round(sorted(ttfts)[int(0.9 * len(ttfts))], 1)}
    finally:
        gw.stop()


def agreement(specs: list[vllm.VllmSpec], model: Path, n: int, logs: Path) -> dict[str, Any]:
    gw = Gateway(_policy(specs, model, {"strategy": "prefix", "index": "precise"}),
                 logs / "gateway-agreement.log")
    rng = random.Random(7)
    tag = time.time_ns()
    try:
        with httpx.Client(timeout=120) as c:
            h = {"Authorization": f"Bearer {KEY}"}
            for i in range(n):
                k = rng.random()
                if k < 0.5:
                    body = {"prompt": DOC.format(tag=f"{tag}-{rng.randrange(12)}")
                            + f" q{i}", "max_tokens": 2}
                    path = "/v1/completions"
                elif k < 0.8:
                    body = {"messages": [{"role": "system", "content": DOC.format(
                        tag=f"sys-{tag}-{rng.randrange(4)}")},
                        {"role": "user", "content": f"question {i}"}], "max_tokens": 2}
                    path = "/v1/chat/completions"
                else:
                    body = {"prompt": f"one-off {tag} {i} " * rng.randrange(10, 100),
                            "max_tokens": 2}
                    path = "/v1/completions"
                r = c.post(gw.url + path, json={"model": "tiny", **body}, headers=h)
                if r.status_code != 200:
                    raise RuntimeError(f"request {i}: {r.status_code} {r.text[:300]}")
        deadline = time.monotonic() + 20
        while True:
            rows = gw.endpoints()
            pairs = [(r["index_blocks"], len(vllm.reported_blocks(s))) for r, s in zip(rows, specs,
                                                                         strict=True)]
            if all(a == b for a, b in pairs) or time.monotonic() > deadline:
                break
            time.sleep(0.3)
        return {"requests": n, "index_vs_engine_blocks": pairs,
                "exact": all(a == b for a, b in pairs),
                "streams": [{k: r["kv_events"][k] for k in ("batches", "replays", "gaps",
                                                              "restarts", "lost", "errors")}
                            for r in rows]}
    finally:
        gw.stop()


def tracing_cost(specs: list[vllm.VllmSpec], model: Path, n: int, logs: Path
                 ) -> dict[str, Any]:
    otlp = OTLPReceiver()
    off = Gateway(_policy(specs[:1], model, {"strategy": "round_robin"}),
                  logs / "gateway-off.log")
    on = Gateway(_policy(specs[:1], model, {"strategy": "round_robin"}, otlp.endpoint),
                 logs / "gateway-on.log")
    times: dict[str, list[float]] = {"direct": [], "off": [], "on": []}
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    try:
        with httpx.Client(timeout=60) as c:
            targets = {"direct": specs[0].url, "off": off.url, "on": on.url}
            for i in range(n + 10):
                order = list(targets)
                random.Random(i).shuffle(order)  # alternate A/B/C, no fixed order
                for k in order:
                    t0 = time.perf_counter()
                    r = c.post(targets[k] + "/v1/chat/completions", json=body,
                               headers={"Authorization": f"Bearer {KEY}"})
                    r.raise_for_status()
                    if i >= 10:  # warm-up
                        times[k].append((time.perf_counter() - t0) * 1e3)
        p50 = {k: statistics.median(v) for k, v in times.items()}
        time.sleep(1.5)
        return {"requests_each": n, "p50_ms": {k: round(v, 2) for k, v in p50.items()},
                "added_p50_ms": {"tracing_off": round(p50["off"] - p50["direct"], 2),
                                 "tracing_on": round(p50["on"] - p50["direct"], 2)},
                "spans_received": len(otlp.spans)}
    finally:
        off.stop()
        on.stop()
        otlp.close()


def main() -> None:
    p = common.parser(__doc__)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--docs", type=int, default=6)
    p.add_argument("--questions", type=int, default=4)
    p.add_argument("--agreement", type=int, default=200)
    p.add_argument("--tracing", type=int, default=100, help="requests per target")
    args = p.parse_args()
    model = vllm.ensure_model()
    logs = Path(tempfile.mkdtemp(prefix="tokengate-bench-vllm-"))
    specs = [vllm.VllmSpec(port=free_port(), core=i, kv_events_port=free_port())
             for i in range(2)]
    for s in specs:
        while True:  # the replay socket takes P+1
            try:
                with socket.socket() as sock:
                    sock.bind(("127.0.0.1", (s.kv_events_port or 0) + 1))
                break
            except OSError:
                s.kv_events_port = free_port()
    procs = [vllm.start(s, logs / f"vllm-{i}.log", model) for i, s in enumerate(specs)]
    out: dict[str, Any] = {"logs": str(logs)}
    try:
        for s, proc, i in zip(specs, procs, range(2), strict=True):
            vllm.wait_ready(s, proc, logs / f"vllm-{i}.log")
        configs = [("round_robin", {"strategy": "round_robin"}),
                   ("prefix_approximate", {"strategy": "prefix", "index": "approximate"}),
                   ("prefix_precise", {"strategy": "prefix", "index": "precise"})]
        runs = []
        for r in range(args.rounds):
            order = configs if r % 2 == 0 else configs[::-1]
            for name, routing in order:
                run = routing_run(specs, model, name, routing, args.docs, args.questions,
                                  seed=r, logs=logs)
                print(json.dumps(run), flush=True)
                runs.append(run)
        out["routing"] = runs
        out["agreement"] = agreement(specs, model, args.agreement, logs)
        print(json.dumps(out["agreement"]), flush=True)
        out["tracing"] = tracing_cost(specs, model, args.tracing, logs)
        print(json.dumps(out["tracing"]), flush=True)
    finally:
        for proc in procs:
            vllm.stop(proc)
    common.show(out)


if __name__ == "__main__":
    main()
