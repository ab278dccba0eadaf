"""Print the reference backend's calibration table (``python -m backend.calibration``).

Modelled TTFT of a lone prompt (chunked at 8,192 tokens, as vLLM's default budget) and decode
step times at several batch sizes, next to published measurements (see docs/calibration.md).
"""

from __future__ import annotations

from roofline.profiles import HARDWARE, MODELS
from roofline.timing import TimingModel

# (what, hardware, modelled-function argument, published value in ms or None, source)
TTFT_REFS = [
    (1024, "h100-sxm", (27.0, 32.0), "derived from Argonne LLM-Inference-Bench (vLLM, "
     "16x1024 in 426 ms, ~55% MFU)"),
    (4096, "h100-sxm", (115.0, 130.0), "derived, same MFU"),
    (16384, "h100-sxm", (550.0, 650.0), "derived, same MFU, attention included"),
    (1024, "h200", (27.0, 32.0), "H200 prefills at H100 speed (TRT-LLM v0.9: 2,048 tokens "
     "30.8 vs 30.2 ms)"),
    (4096, "h200", (115.0, 130.0), "same"),
    (16384, "h200", (550.0, 650.0), "same"),
]
DECODE_REFS = [
    (1, 192, "h100-sxm", (7.8, 7.8), "Argonne, vLLM fp16, 128 in/128 out, batch 1"),
    (32, 192, "h100-sxm", (9.5, 9.5), "Argonne, batch 32"),
    (64, 192, "h100-sxm", (11.6, 11.6), "Argonne, batch 64"),
    (128, 192, "h100-sxm", None, "no published BF16 vLLM figure (NIM FP8: 7.6 ms at 100, "
     "9.8 at 150, with half the weight bytes)"),
    (8, 96, "h100-sxm", (7.8, 7.8), "vLLM nightly latency test, 32 in/128 out, batch 8"),
    (1, 192, "h200", None, "no direct figure; H200/H100 ≈ 0.84 at small batch (vLLM nightly)"),
    (8, 96, "h200", (6.5, 6.5), "vLLM nightly latency test, batch 8"),
    (32, 192, "h200", None, "—"),
    (128, 192, "h200", None, "—"),
]

TP4_REFS = [
    (8, 96, "h100-sxm", (19.1, 19.1), "vLLM nightly latency test, llama-3-70b TP4, batch 8"),
    (8, 96, "h200", (16.2, 16.2), "same, H200"),
]


def _gap(ms: float, ref: tuple[float, float] | None) -> str:
    if ref is None:
        return "—"
    lo, hi = ref
    if lo <= ms <= hi:
        return "within"
    target = lo if ms < lo else hi
    return f"{(ms - target) / target:+.0%}"


def _ref(ref: tuple[float, float] | None) -> str:
    if ref is None:
        return "—"
    return f"{ref[0]:g}" if ref[0] == ref[1] else f"{ref[0]:g}–{ref[1]:g}"


def table(model: str = "llama-3-8b") -> str:
    m = MODELS[model]
    rows = ["| quantity | hardware | modelled (ms) | published (ms) | gap | source |",
            "| --- | --- | ---: | ---: | ---: | --- |"]
    for tokens, hw, ref, src in TTFT_REFS:
        ms = TimingModel(m, HARDWARE[hw], jitter=0).prefill_seconds(tokens, 8192) * 1e3
        rows.append(f"| TTFT, {tokens // 1024}K prompt | {hw} | {ms:.1f} | {_ref(ref)} | "
                    f"{_gap(ms, ref)} | {src} |")
    for batch, ctx, hw, dref, src in DECODE_REFS:
        ms = TimingModel(m, HARDWARE[hw], jitter=0).decode_step_seconds(batch, ctx) * 1e3
        rows.append(f"| decode step, batch {batch} (ctx {ctx}) | {hw} | {ms:.2f} | "
                    f"{_ref(dref)} | {_gap(ms, dref)} | {src} |")
    m70 = MODELS["llama-3-70b"]
    for batch, ctx, hw, dref, src in TP4_REFS:
        ms = TimingModel(m70, HARDWARE[hw], jitter=0).decode_step_seconds(batch, ctx) * 1e3
        rows.append(f"| llama-3-70b TP4 decode step, batch {batch} (ctx {ctx}) | {hw} | "
                    f"{ms:.2f} | {_ref(dref)} | {_gap(ms, dref)} | {src} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(f"llama-3-8b (BF16, TP1), default engine settings\n\n{table()}")
