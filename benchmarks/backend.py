"""Benchmark: replay an Azure LLM trace against one reference-backend instance.

    python -m benchmarks.backend [--window 600] [--time-scale 1.0] [--out FILE]

Starts ``tokengate backend`` as a child process, replays the trace open-loop (arrivals follow
the timestamps, never wait for responses; prompts are token-id lists of the exact length, output
forced with ``max_tokens`` + ``ignore_eos``), and reports throughput, TTFT/TPOT/ITL percentiles
(vLLM ``bench serve`` definitions), the engine loop's lag behind real time, the backend process's
CPU time per generated token, and the client's own event-loop lag.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import aiohttp

from benchmarks import common
from loadtests.client import RequestResult, stream_request, wait_for
from loadtests.metrics import summarize
from loadtests.runner import LoopLag
from loadtests.traces import TRACES, TraceRequest, load_azure
from protocol.loopback import free_port

DEFAULT_TRACE = TRACES / "azure_llm_2023_conv.csv"


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0




def start_backend(args: argparse.Namespace) -> tuple[subprocess.Popen[str], str]:
    port = free_port()
    cmd = [sys.executable, "-m", "tokengate", "backend", "--port", str(port), "--model",
           args.model, "--hardware", args.hardware, "--time-scale", str(args.time_scale),
           "--seed", "1", "--log-level", "warning"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    threading.Thread(target=proc.stderr.read, daemon=True).start()
    return proc, f"http://127.0.0.1:{port}"


async def replay(urls: list[str], model: str, trace: list[TraceRequest], max_len: int,
                 seed: int) -> tuple[list[RequestResult], float]:
    rng = random.Random(seed)
    results: list[RequestResult] = []
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn) as session:
        start = time.perf_counter()
        tasks = []
        for i, tr in enumerate(trace):
            url = urls[i % len(urls)]
            n_in = min(tr.input_tokens, max_len - tr.output_tokens - 1)
            body = {"model": model, "prompt": [rng.randrange(100_000) for _ in range(n_in)],
                    "max_tokens": tr.output_tokens, "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}}
            delay = start + tr.t - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.ensure_future(
                stream_request(session, f"{url}/v1/completions", body)))
        results = list(await asyncio.gather(*tasks))
        duration = time.perf_counter() - start
    return results, duration


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    trace = load_azure(args.trace, window_s=args.window, limit=args.limit)
    trace = [TraceRequest(t.t * args.time_scale, t.input_tokens, t.output_tokens) for t in trace]
    procs: list[subprocess.Popen[str]] = []
    urls: list[str] = []
    try:
        for _ in range(args.instances):
            proc, url = start_backend(args)
            procs.append(proc)
            urls.append(url)
        for url in urls:
            await wait_for(f"{url}/health")
        async with aiohttp.ClientSession() as s, s.get(f"{urls[0]}/v1/models") as r:
            max_len = (await r.json())["data"][0]["max_model_len"]
        cpu0 = [_cpu_seconds(p.pid) for p in procs]
        lag = LoopLag()
        lag.start()
        results, duration = await replay(urls, args.model, trace, max_len, args.seed)
        client_lag = lag.stop()
        cpu = sum(_cpu_seconds(p.pid) - c for p, c in zip(procs, cpu0, strict=True))
        rss = [_rss_mib(p.pid) for p in procs]
        states = []
        async with aiohttp.ClientSession() as s:
            for url in urls:
                async with s.get(f"{url}/admin/state") as r:
                    states.append(await r.json())
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(10)
    report = summarize(results, duration)
    loops = [st["loop"] for st in states]
    steps = sum(lp["steps"] for lp in loops)
    report["backend"] = {
        "model": args.model, "hardware": args.hardware, "time_scale": args.time_scale,
        "instances": args.instances,
        "loop": {"steps": steps,
                 "mean_lag_ms": sum(lp["mean_lag_s"] * lp["steps"] for lp in loops)
                 / max(steps, 1) * 1e3,
                 "max_lag_ms": max(lp["max_lag_s"] for lp in loops) * 1e3,
                 "resyncs": sum(lp["resyncs"] for lp in loops),
                 "gpu_busy_fraction": sum(lp["busy_s"] for lp in loops)
                 * args.time_scale / duration / args.instances},
        "preemptions": sum(st["preemptions"] for st in states),
        "cpu_seconds": cpu,
        "cpu_ms_per_output_token": cpu * 1e3 / max(report["total_output_tokens"], 1),
        "rss_mib": rss}
    report["client_loop_lag"] = client_lag
    report["trace"] = {"file": str(args.trace), "window_s": args.window,
                       "requests": len(trace)}
    return report


def main() -> None:
    p = common.parser(__doc__)
    p.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    p.add_argument("--window", type=float, default=600.0, help="seconds of the trace to replay")
    p.add_argument("--limit", type=int)
    p.add_argument("--time-scale", type=float, default=1.0)
    p.add_argument("--model", default="llama-3.1-8b")
    p.add_argument("--hardware", default="h100-sxm")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--instances", type=int, default=1,
                   help="backend processes; requests are spread round-robin")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    report = asyncio.run(main_async(args))
    text = json.dumps(report, indent=2)
    if args.out:
        args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
