"""Real-kernel step times on a GPU, for calibrating the reference backend's timing model.

``python -m benchmarks.kernels measure OUT.json`` (on a machine with a CUDA GPU and PyTorch)
builds a model of the given shape with random BF16 weights and times, with CUDA graphs and CUDA
events, the steps a continuous-batching engine runs: a lone prompt prefilled in chunks of 8,192
tokens, decode steps of ``batch`` sequences at ``context`` tokens each, and mixed steps (one
prefill chunk and a decode batch in one forward, as chunked prefill schedules them). It also
measures the ceilings: a large BF16 matrix product, device copies and host <-> device copies
(pinned and pageable), which price a model switch.

``python -m benchmarks.kernels compare OUT.json`` prints each measured step beside the
timing model's figure for the same work (``roofline.timing``), the kernel part (no engine
overhead) and the whole step, and the MFU and bandwidth efficiency the kernels reached.

What is measured is the kernels alone: an engine adds its scheduler, sampling and the host
side of each step (the timing model's ``step_overhead_s`` and ``per_seq_overhead_s``).
Attention is PyTorch's ``scaled_dot_product_attention`` (flash or cuDNN kernels, contiguous
KV), not a paged kernel; projections and MLP are cuBLAS GEMMs, unfused elementwise ops between.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from benchmarks.kernel_model import LLAMA3_8B, LLAMA3_70B_TP4, Model, Shape, caches, load_torch

CHUNK = 8192
KV_LIMIT_BYTES = 72e9


def _time_step(m: Model, pre: tuple[int, int] | None, dec: tuple[int, int] | None,
               sample_prefill: bool, reps: int = 10) -> tuple[float, str]:
    """Median milliseconds of one step (CUDA graph replay, else eager) and how it ran."""
    t = m.t
    n = (pre or (0, 0))[0]
    b = (dec or (0, 0))[0]
    kv = caches(m, pre, dec)
    ids = t.randint(0, m.shape.vocab, (n + b,), device=m.dev)
    how = "graph"
    if m.dev == "cpu":
        with t.no_grad():
            t0 = time.perf_counter()
            m.step(ids, pre, dec, kv, sample_prefill)
        return (time.perf_counter() - t0) * 1e3, "cpu"
    with t.no_grad():
        for _ in range(2):
            m.step(ids, pre, dec, kv, sample_prefill)
        t.cuda.synchronize()
        try:
            g = t.cuda.CUDAGraph()
            with t.cuda.graph(g):
                m.step(ids, pre, dec, kv, sample_prefill)

            def run() -> None:
                g.replay()
        except RuntimeError:
            how = "eager"
            t.cuda.synchronize()

            def run() -> None:
                m.step(ids, pre, dec, kv, sample_prefill)
        for _ in range(3):
            run()
        t.cuda.synchronize()
        times = []
        for _ in range(reps):
            start = t.cuda.Event(enable_timing=True)
            end = t.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
    kv.clear()
    if how == "graph":
        del g
    t.cuda.empty_cache()
    return statistics.median(times), how


def _ceilings() -> dict[str, float]:
    t = load_torch()
    out: dict[str, float] = {}
    a = t.randn(8192, 8192, device="cuda", dtype=t.bfloat16)
    bm = t.randn(8192, 8192, device="cuda", dtype=t.bfloat16)
    for _ in range(3):
        a @ bm
    t.cuda.synchronize()
    s = t.cuda.Event(enable_timing=True)
    e = t.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(10):
        a @ bm
    e.record()
    e.synchronize()
    out["bf16_matmul_tflops"] = 10 * 2 * 8192**3 / (s.elapsed_time(e) / 1e3) / 1e12
    del a, bm
    size = 4 * 1024**3
    src = t.empty(size, dtype=t.uint8, device="cuda")
    dst = t.empty(size, dtype=t.uint8, device="cuda")
    dst.copy_(src)
    t.cuda.synchronize()
    s.record()
    for _ in range(5):
        dst.copy_(src)
    e.record()
    e.synchronize()
    out["d2d_copy_gbps_read_plus_write"] = 5 * 2 * size / (s.elapsed_time(e) / 1e3) / 1e9
    del dst
    for pinned in (True, False):
        host = t.empty(size, dtype=t.uint8, pin_memory=pinned)
        host.fill_(1)
        src.copy_(host, non_blocking=pinned)
        t.cuda.synchronize()
        label = "pinned" if pinned else "pageable"
        t0 = time.perf_counter()
        for _ in range(3):
            src.copy_(host, non_blocking=pinned)
        t.cuda.synchronize()
        out[f"h2d_{label}_gbps"] = 3 * size / (time.perf_counter() - t0) / 1e9
        t0 = time.perf_counter()
        for _ in range(3):
            host.copy_(src, non_blocking=pinned)
        t.cuda.synchronize()
        out[f"d2h_{label}_gbps"] = 3 * size / (time.perf_counter() - t0) / 1e9
        del host
    del src
    t.cuda.empty_cache()
    return out


def _kv_bytes(s: Shape, tokens: int) -> float:
    return 2.0 * s.layers * s.kv_heads * s.head_dim * 2 * tokens


def _measure_shape(s: Shape, prompts: list[int], decode: list[tuple[int, int]],
                   mixed: list[tuple[int, int, int]], dev: str = "cuda") -> list[dict[str, Any]]:
    m = Model(s, dev)
    rows: list[dict[str, Any]] = []

    def note(row: dict[str, Any]) -> None:
        rows.append(row)
        print(json.dumps(row), flush=True)

    for prompt in prompts:
        total = 0.0
        hows = set()
        done = 0
        while done < prompt:
            n = min(CHUNK, prompt - done)
            ms, how = _time_step(m, (n, done), None, done + n >= prompt)
            total += ms
            hows.add(how)
            done += n
        note({"kind": "prefill", "shape": s.name, "profile": s.profile, "tp": s.tp,
              "prompt": prompt, "ms": total, "how": "+".join(sorted(hows))})
    for batch, ctx in decode:
        if _kv_bytes(s, batch * (ctx + 1)) > KV_LIMIT_BYTES:
            continue
        ms, how = _time_step(m, None, (batch, ctx), False)
        note({"kind": "decode", "shape": s.name, "profile": s.profile, "tp": s.tp,
              "batch": batch, "context": ctx, "ms": ms, "how": how})
    for n, batch, ctx in mixed:
        ms, how = _time_step(m, (n, 0), (batch, ctx), True)
        note({"kind": "mixed", "shape": s.name, "profile": s.profile, "tp": s.tp,
              "chunk": n, "batch": batch, "context": ctx, "ms": ms, "how": how})
    rows.append({"kind": "attention_path", "shape": s.name, "path": m.gqa_path})
    del m
    if dev != "cpu":
        load_torch().cuda.empty_cache()
    return rows


def measure(out: Path) -> None:
    t = load_torch()
    t.manual_seed(0)
    info = {"device": t.cuda.get_device_name(0), "torch": t.__version__,
            "cuda": t.version.cuda, "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    print(json.dumps(info), flush=True)
    result: dict[str, Any] = {"info": info, "ceilings": _ceilings(), "steps": []}
    print(json.dumps(result["ceilings"]), flush=True)
    out.write_text(json.dumps(result, indent=1))
    batches = [1, 8, 32, 64, 128, 256]
    contexts = [192, 2048, 8192, 32768]
    result["steps"] += _measure_shape(
        LLAMA3_8B, [512, 1024, 2048, 4096, 8192, 16384, 32768],
        [(b, c) for c in contexts for b in batches],
        [(512, 32, 2048), (2048, 32, 2048), (8192, 32, 2048), (2048, 128, 2048)])
    out.write_text(json.dumps(result, indent=1))
    result["steps"] += _measure_shape(
        LLAMA3_70B_TP4, [1024, 4096], [(1, 96), (8, 96), (32, 192), (64, 192)], [])
    out.write_text(json.dumps(result, indent=1))
    result["shapes"] = [asdict(LLAMA3_8B), asdict(LLAMA3_70B_TP4)]
    out.write_text(json.dumps(result, indent=1))


def modelled(row: dict[str, Any], hardware: str = "h200") -> tuple[float, float, float, float]:
    """(kernel ms, whole-step ms, FLOPs, bytes) the timing model gives ``row``'s work; for a
    TP shard, its FLOPs and bytes without the all-reduces (what one GPU's kernels do)."""
    from roofline.profiles import HARDWARE, MODELS
    from roofline.timing import TimingModel

    tm = TimingModel(MODELS[row["profile"]], HARDWARE[hardware], jitter=0)
    steps: list[tuple[list[tuple[int, int]], int]] = []
    if row["kind"] == "prefill":
        done = 0
        while done < row["prompt"]:
            n = min(CHUNK, row["prompt"] - done)
            steps.append(([(n, done)], 1 if done + n >= row["prompt"] else 0))
            done += n
    elif row["kind"] == "decode":
        steps.append(([(1, row["context"])] * row["batch"], row["batch"]))
    else:
        steps.append(([(row["chunk"], 0)] + [(1, row["context"])] * row["batch"],
                      1 + row["batch"]))
    kernel = whole = flops = nbytes = 0.0
    for work, sampled in steps:
        c = tm.cost(work, sampled)
        kernel += c.kernel_s
        whole += c.seconds
        flops += c.flops
        nbytes += c.bytes
    return kernel * 1e3, whole * 1e3, flops, nbytes


def compare(path: Path, hardware: str = "h200") -> str:
    from roofline.profiles import HARDWARE

    data = json.loads(path.read_text())
    hw = HARDWARE[hardware]
    lines = [f"measured on {data['info']['device']} (torch {data['info']['torch']}, "
             f"CUDA {data['info']['cuda']}), against the `{hardware}` profile",
             "", "| ceiling | measured |", "| --- | ---: |"]
    for k, v in data["ceilings"].items():
        lines.append(f"| {k} | {v:,.0f} |")
    lines += ["", "| step | shape | measured kernels (ms) | model, kernels (ms) | model/measured "
              "| model, whole step (ms) | reached MFU | reached HBM (TB/s) |",
              "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for row in data["steps"]:
        if row["kind"] == "attention_path":
            continue
        k_ms, w_ms, flops, nbytes = modelled(row, hardware)
        if row["kind"] == "prefill":
            what = f"prefill {row['prompt']:,}"
        elif row["kind"] == "decode":
            what = f"decode b{row['batch']} ctx {row['context']:,}"
        else:
            what = f"chunk {row['chunk']:,} + decode b{row['batch']} ctx {row['context']:,}"
        secs = row["ms"] / 1e3
        mfu = flops / secs / hw.peak_flops
        tbs = nbytes / secs / 1e12
        lines.append(f"| {what} | {row['shape']} | {row['ms']:.2f} | {k_ms:.2f} | "
                     f"{k_ms / row['ms']:.2f} | {w_ms:.2f} | {mfu:.2f} | {tbs:.2f} |")
    return "\n".join(lines)


def dry_run() -> None:
    """Every code path of ``measure`` on a tiny shape on the CPU (no timings worth keeping)."""
    tiny = Shape("tiny", "llama-3-8b", 2, 64, 4, 2, 16, 128, 256)
    global CHUNK
    CHUNK, kept = 32, CHUNK
    try:
        rows = _measure_shape(tiny, [16, 80], [(2, 8)], [(16, 2, 8)], dev="cpu")
    finally:
        CHUNK = kept
    assert [r["kind"] for r in rows] == ["prefill", "prefill", "decode", "mixed",
                                        "attention_path"], rows


def main(argv: list[str]) -> int:
    if argv == ["dry"]:
        dry_run()
        return 0
    if len(argv) != 2 or argv[0] not in ("measure", "compare"):
        print("usage: python -m benchmarks.kernels measure|compare FILE.json | dry",
              file=sys.stderr)
        return 2
    if argv[0] == "measure":
        measure(Path(argv[1]))
    else:
        print(compare(Path(argv[1])))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
