"""Roofline timing arithmetic, calibration anchors, and profile loading."""

from __future__ import annotations

from pathlib import Path

import pytest

from backend.engine_config import EngineConfig, num_gpu_blocks
from roofline.profiles import HARDWARE, MODELS, ProfileError, load_profiles
from roofline.timing import TimingModel


def tm(model: str = "llama-3-8b", hw: str = "h100-sxm") -> TimingModel:
    return TimingModel(MODELS[model], HARDWARE[hw], jitter=0.0)


def test_cost_arithmetic_by_hand() -> None:
    m, hw = MODELS["llama-3-8b"], HARDWARE["h100-sxm"]
    cost = tm().cost([(100, 50)], num_sampled=1)
    pairs = 100 * 50 + 100 * 101 / 2
    flops = 2 * m.matmul_params * 100 + 2 * m.embedding_params + 4 * 32 * 32 * 128 * pairs
    assert cost.flops == pytest.approx(flops)
    assert cost.bytes == pytest.approx(m.weight_bytes + 150 * 131072)
    assert cost.compute_s == pytest.approx(flops / (hw.peak_flops * hw.mfu))
    assert cost.memory_s == pytest.approx(cost.bytes / (hw.hbm_bandwidth * hw.mem_efficiency))
    rc, rm = hw.peak_flops * hw.mfu, hw.hbm_bandwidth * hw.mem_efficiency
    gemm = 2 * m.matmul_params * 100 + 2 * m.embedding_params
    attention = 4 * 32 * 32 * 128 * pairs
    kernels = max(gemm / rc, m.weight_bytes / rm) + max(attention / rc, 150 * 131072 / rm)
    assert cost.seconds == pytest.approx(kernels + hw.step_overhead_s + hw.per_seq_overhead_s)
    assert tm().seconds(100, pairs, 150, 1, 1) == pytest.approx(cost.seconds)


RESULTS = Path(__file__).parent.parent / "benchmarks" / "results" / "kernels-h200-2026-12-04"


@pytest.mark.parametrize("run", ["run1.json", "run2.json"])
def test_timing_model_against_kernels_measured_on_an_h200(run: str) -> None:
    """Real kernels (llama-3-8b shape, random BF16 weights, CUDA graphs; benchmarks.kernels):
    the model's GEMM-bound prefill is within 5 % of them, no whole modelled step is faster
    than its kernels alone, and a prefill chunk beside a decode batch is priced within 15 % of
    its kernels (one roofline over the step's totals priced the smallest 24 % under)."""
    import json

    from benchmarks.kernels import modelled

    rows = [r for r in json.loads((RESULTS / run).read_text())["steps"]
            if r["kind"] != "attention_path" and r["profile"] == "llama-3-8b"]
    assert len(rows) >= 29
    for row in rows:
        kernel_ms, whole_ms, _, _ = modelled(row)
        if row["kind"] == "prefill" and 1024 <= row["prompt"] <= 8192:
            assert kernel_ms == pytest.approx(row["ms"], rel=0.05), row
        if row["kind"] == "decode":
            assert whole_ms >= row["ms"], row
        if row["kind"] == "mixed":
            assert kernel_ms == pytest.approx(row["ms"], rel=0.15), row


def test_prefill_is_compute_bound_and_decode_memory_bound() -> None:
    t = tm()
    prefill = t.cost([(4096, 0)], 1)
    decode = t.cost([(1, 512)] * 8, 8)
    assert prefill.compute_s > prefill.memory_s
    assert decode.memory_s > decode.compute_s


@pytest.mark.parametrize(("tokens", "lo", "hi"), [(1024, 0.027, 0.032), (4096, 0.115, 0.130),
                                                  (16384, 0.55, 0.65)])
def test_llama3_8b_h100_ttft_matches_published_range(tokens: int, lo: float, hi: float) -> None:
    assert lo <= tm().prefill_seconds(tokens, 8192) <= hi


def test_decode_step_grows_with_batch_like_measurements() -> None:
    t = tm()
    one, b64 = t.decode_step_seconds(1, 192), t.decode_step_seconds(64, 192)
    assert one == pytest.approx(7.8e-3, rel=0.05)
    assert b64 == pytest.approx(11.6e-3, rel=0.05)
    # H200 decodes ~16% faster at small batch, not the 30% its bandwidth alone suggests.
    ratio = tm(hw="h200").decode_step_seconds(8, 160) / t.decode_step_seconds(8, 160)
    assert 0.75 < ratio < 0.90


def test_tensor_parallel_adds_allreduce_cost() -> None:
    m70 = MODELS["llama-3-70b"]
    assert m70.tensor_parallel == 4
    step = tm("llama-3-70b").decode_step_seconds(8, 160)
    assert step == pytest.approx(19.1e-3, rel=0.1)


def test_jitter_is_seeded() -> None:
    a = TimingModel(MODELS["llama-3-8b"], HARDWARE["h100-sxm"], jitter=0.05, seed=3)
    b = TimingModel(MODELS["llama-3-8b"], HARDWARE["h100-sxm"], jitter=0.05, seed=3)
    xs = [a.step_seconds([(1, 100)], 1) for _ in range(5)]
    assert xs == [b.step_seconds([(1, 100)], 1) for _ in range(5)]
    assert len(set(xs)) == 5


def test_kv_cache_size_from_memory() -> None:
    blocks = num_gpu_blocks(MODELS["llama-3-8b"], HARDWARE["h100-sxm"], EngineConfig())
    # (79.6 GiB * 0.9 - 16.06 GB weights - 2 GiB) / (128 KiB * 16) ≈ 27,997
    assert 27_500 < blocks < 28_500
    assert num_gpu_blocks(MODELS["llama-3-70b"], HARDWARE["h100-sxm"], EngineConfig()) > 0


def test_user_profiles_with_base_and_strict_fields(tmp_path: Path) -> None:
    f = tmp_path / "p.yaml"
    f.write_text("hardware:\n  my-gpu:\n    base: h100-sxm\n    hbm_bandwidth: 5.0e12\n"
                 "models:\n  tiny:\n    params: 1.0e9\n    num_layers: 8\n    hidden_size: 1024\n"
                 "    num_heads: 8\n    num_kv_heads: 8\n    head_dim: 128\n"
                 "    vocab_size: 32000\n    max_model_len: 4096\n")
    cat = load_profiles(f)
    assert cat.get_hardware("my-gpu").hbm_bandwidth == 5.0e12
    assert cat.get_hardware("my-gpu").peak_flops == HARDWARE["h100-sxm"].peak_flops
    assert cat.get_model("tiny").kv_bytes_per_token == 2 * 8 * 8 * 128 * 2
    f.write_text("hardware:\n  bad:\n    base: h100-sxm\n    hbm_bandwith: 1\n")
    with pytest.raises(ProfileError, match=r"p.yaml: hardware.bad.hbm_bandwith: unknown field"):
        load_profiles(f)
    f.write_text("models:\n  m:\n    params: 1.0e9\n")
    with pytest.raises(ProfileError, match="missing required fields"):
        load_profiles(f)
    with pytest.raises(ProfileError, match="unknown hardware profile"):
        cat.get_hardware("tpu")
