"""Load-harness arithmetic and workload generation, checked against hand-computed cases."""

from __future__ import annotations

import itertools
import random
import statistics
from pathlib import Path

import pytest

from backend.textgen import LengthDistribution
from loadtests import workloads
from loadtests.client import RequestResult
from loadtests.metrics import SLO, summarize, tpot
from loadtests.prompts import PromptMaker
from loadtests.traces import TRACES, load_azure
from protocol.tokenizer import Tokenizer


def result(sent: float, chunks: list[float], tokens: int, error: str | None = None
           ) -> RequestResult:
    r = RequestResult(sent_at=sent, chunk_times=chunks, output_tokens=tokens, error=error)
    if chunks:
        r.ttft, r.latency = chunks[0] - sent, chunks[-1] - sent
    return r


def test_metrics_match_hand_computation() -> None:
    a = result(0.0, [0.1, 0.2, 0.4], 3)  # TTFT 100, TPOT (400-100)/2 = 150, ITL 100 and 200
    b = result(1.0, [1.05], 1)  # one token: TTFT = E2E = 50, no TPOT, no ITL
    c = result(1.5, [], 0, error="http_500")
    assert tpot(a) == pytest.approx(0.15) and tpot(b) is None
    rep = summarize([a, b, c], 2.0, SLO(ttft_ms=80))
    assert (rep["requests"], rep["completed"], rep["failed"]) == (3, 2, 1)
    assert rep["request_throughput"] == 1.0 and rep["output_throughput"] == 2.0
    assert rep["ttft_ms"]["mean"] == pytest.approx(75) and rep["ttft_ms"]["p50"] == \
        pytest.approx(75)
    assert rep["tpot_ms"]["p50"] == pytest.approx(150) and rep["tpot_ms"]["p99"] == \
        pytest.approx(150)
    assert rep["itl_ms"]["mean"] == pytest.approx(150) and rep["itl_ms"]["max"] == \
        pytest.approx(200)
    assert rep["e2e_ms"]["p50"] == pytest.approx(225)
    assert rep["goodput_rps"] == 0.5 and rep["goodput_fraction"] == pytest.approx(1 / 3)
    assert rep["errors"] == {"http_500": 1}
    # SLOs on TPOT and E2E: a fails the TPOT bound, b passes everything (it has no TPOT).
    rep2 = summarize([a, b, c], 2.0, SLO(tpot_ms=100, e2e_ms=500))
    assert rep2["goodput_fraction"] == pytest.approx(1 / 3)
    empty = summarize([c], 1.0)
    assert empty["ttft_ms"]["p50"] is None and empty["completed"] == 0


def test_gamma_schedule_rate_and_burstiness() -> None:
    for shape, cv2 in ((1.0, 1.0), (0.25, 4.0), (4.0, 0.25)):
        t = workloads.gamma_arrivals(20000, 10.0, shape, random.Random(1))
        gaps = [b - a for a, b in zip([0.0, *t], t, strict=False)]
        mean = statistics.fmean(gaps)
        assert mean == pytest.approx(0.1, rel=0.05)
        assert statistics.pvariance(gaps) / mean**2 == pytest.approx(cv2, rel=0.1)
    with pytest.raises(ValueError):
        workloads.gamma_arrivals(3, 0.0, 1.0, random.Random())


def test_mooncake_prompts_share_blocks_exactly_per_hash_ids(tokenizer: Tokenizer) -> None:
    m = PromptMaker(tokenizer)
    a = tokenizer.encode(m.mooncake([1, 2, 3], 1300))
    b = tokenizer.encode(m.mooncake([1, 2, 4], 1100))
    c = tokenizer.encode(m.mooncake([5], 300))
    assert (len(a), len(b), len(c)) == (1300, 1100, 300)
    assert a[:1024] == b[:1024] and a[1024] != b[1024]
    assert a[0] != c[0]
    rows = workloads.load_mooncake(TRACES / "mooncake_synthetic.jsonl", limit=40)
    ids = [tokenizer.encode(m.mooncake(r["hash_ids"], r["input_length"])) for r in rows]
    for r, t in zip(rows, ids, strict=True):
        assert len(t) == r["input_length"]
    for i in range(len(rows)):
        for j in range(i + 1, len(rows)):
            hi, hj = rows[i]["hash_ids"], rows[j]["hash_ids"]
            k = next((n for n, (x, y) in enumerate(zip(hi, hj, strict=False)) if x != y),
                     min(len(hi), len(hj)))
            shared = min(k * 512, len(ids[i]), len(ids[j]))
            assert ids[i][:shared] == ids[j][:shared]
            if shared + 2 <= min(len(ids[i]), len(ids[j])):
                # No accidental sharing: different ids differ within a block's first 2 tokens.
                assert ids[i][shared:shared + 2] != ids[j][shared:shared + 2], (i, j)


def test_exact_lengths_for_synthetic_prompts(tokenizer: Tokenizer) -> None:
    m = PromptMaker(tokenizer, seed=3)
    plan = workloads.synthetic(30, 5.0, 1.0, workloads.parse_lengths("uniform:1:3000", "input"),
                               workloads.parse_lengths("fixed:7", "output"), m, seed=3)
    assert all(len(tokenizer.encode(p.prompt)) == p.input_tokens for p in plan)
    again = workloads.synthetic(30, 5.0, 1.0, workloads.parse_lengths("uniform:1:3000", "input"),
                                workloads.parse_lengths("fixed:7", "output"),
                                PromptMaker(tokenizer, seed=3), seed=3)
    assert [(p.t, p.prompt) for p in plan] == [(p.t, p.prompt) for p in again]


def test_length_specs() -> None:
    rng = random.Random(0)
    assert workloads.parse_lengths("fixed:5", "input").sample(rng) == 5
    n = workloads.parse_lengths("normal:100:10", "input")
    assert statistics.fmean(n.sample(rng) for _ in range(5000)) == pytest.approx(100, rel=0.02)
    tr = workloads.parse_lengths(f"trace:{TRACES / 'azure_llm_2023_code.csv'}", "output")
    assert max(tr.samples) > 1 and tr.sample(rng) in tr.samples
    for bad in ("fixed", "poisson:3", "uniform:5:2", "fixed:0", "normal:a:b"):
        with pytest.raises(ValueError, match="length spec"):
            workloads.parse_lengths(bad, "input")


def test_azure_parsing() -> None:
    rows = load_azure(TRACES / "azure_llm_2023_conv.csv", limit=3)
    assert [(r.input_tokens, r.output_tokens) for r in rows] == [(374, 44), (396, 109),
                                                                 (879, 55)]
    assert rows[0].t == 0.0 and rows[1].t == pytest.approx(4.314579)
    window = load_azure(TRACES / "azure_llm_2023_conv.csv", window_s=60)
    assert window and window[-1].t <= 60 and len(window) < 19366


def test_azure_parser_rejects_other_files(tmp_path: Path) -> None:
    f = tmp_path / "x.csv"
    f.write_text("a,b\n1,2\n")
    with pytest.raises(ValueError, match="not an Azure LLM trace"):
        load_azure(f)
    f.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.68,x,1\n")
    with pytest.raises(ValueError, match=r"x.csv:2: bad row"):
        load_azure(f)


def test_sessions_grow_context_past_100k_at_100_to_1(tokenizer: Tokenizer) -> None:
    spec = workloads.SessionSpec(sessions=2, turns=50, agent_types=1, system_tokens=2000,
                                 task_tokens=200, tool_tokens=2000,
                                 output=LengthDistribution("fixed", 20), think_time_s=0)
    ss = workloads.sessions(spec, 1.0, 1.0, PromptMaker(tokenizer), seed=1)
    assert ss[0].system == ss[1].system  # one agent type: a shared system prompt
    s = ss[0]
    sizes = []
    answer = None
    for turn in range(spec.turns):
        msgs = s.next_messages(turn, answer)
        sizes.append(len(tokenizer.chat_ids(msgs)))
        answer = " ok" * s.outputs[turn]
    assert all(b > a for a, b in itertools.pairwise(sizes))
    assert sizes[-1] > 100_000
    assert sizes[-1] / s.outputs[-1] > 100  # input:output beyond 100:1


def test_target_mirrors_alternate_per_request() -> None:
    from loadtests.runner import Target

    t = Target("gw", "http://a:1/v1", mirrors=("http://b:2/v1",))
    urls = [t.url("chat") for _ in range(4)]
    assert urls == ["http://b:2/v1/chat/completions", "http://a:1/v1/chat/completions"] * 2


def test_predictability_tells_decision_time_from_hindsight() -> None:
    """A run where each stream's TPOT is set by the prefills that reach its endpoint while it
    decodes (arrivals after its own send): hindsight predicts it, decision time cannot."""
    from benchmarks.predictability import bounds

    rng = random.Random(3)
    sends = sorted(rng.uniform(0, 400) for _ in range(400))
    prompts = [rng.randint(200, 8000) for _ in sends]
    ttfts = [0.02 + p / 40_000 for p in prompts]
    outs = [rng.randint(20, 200) for _ in sends]
    results = []
    for i, (s, p, t, o) in enumerate(zip(sends, prompts, ttfts, outs, strict=True)):
        start = s + t
        step = 0.010  # decode-only step; each prefill overlapping the decode adds its time
        for _ in range(3):  # the window depends on the TPOT it sets: iterate to a fixed point
            end = start + (o - 1) * step
            extra = sum(min(sends[j] + ttfts[j], end) - max(sends[j], start)
                        for j in range(len(sends)) if j != i
                        and sends[j] < end and sends[j] + ttfts[j] > start)
            step = 0.010 + extra / max(o - 1, 1)
        results.append(RequestResult(sent_at=100.0 + s, ttft=t, latency=t + (o - 1) * step,
                                     output_tokens=o, prompt_tokens=p, endpoint="e"))
    b = bounds(results, 100.0, warmup_s=0.0)
    tp = b["tpot"]
    assert tp["n"] == 400
    assert tp["hindsight"] < 0.5 * tp["decision_time"]
    assert tp["decision_time"] > 0.8 * tp["median_only"]  # the past barely helps
    assert tp["corr_with_prefill_during_decode"] > 0.5
    assert b["ttft"]["hindsight"] < 0.2  # TTFT here is the prompt's own prefill: predictable


def test_predictability_counts_prompts_that_arrive_during_a_prefill() -> None:
    """A run where each prompt's TTFT grows with the prompts that reach its endpoint while it
    is being computed (they share its last chunk step): only the bound that knows those later
    arrivals predicts it."""
    from benchmarks.predictability import bounds

    rng = random.Random(5)
    sends = sorted(rng.uniform(0, 300) for _ in range(400))
    prompts = [rng.randint(200, 8000) for _ in sends]
    results = []
    for i, (s, p) in enumerate(zip(sends, prompts, strict=True)):
        own = 0.02 + p / 40_000
        later = sum(prompts[j] for j in range(i + 1, len(sends)) if sends[j] < s + own)
        ttft = own + later / 10_000
        results.append(RequestResult(sent_at=100.0 + s, ttft=ttft, latency=ttft + 0.5,
                                     output_tokens=20, prompt_tokens=p, endpoint="e"))
    tt = bounds(results, 100.0, warmup_s=0.0)["ttft"]
    assert tt["n"] == 400
    assert tt["hindsight_with_arrivals"] < 0.5 * tt["hindsight"]


def test_the_soak_fails_on_errors_or_a_resource_that_keeps_growing() -> None:
    """``make soak`` (10 minutes, outside the suite) exits 1 on the verdict's reasons."""
    from benchmarks.soak import verdict

    ok = {"errors": 0, "error_rate": 0.0, "requests": 4000,
          "slopes_per_min": {"rss_mb": 0.99, "fds": 0.0, "upstream_conns": 0.1}}
    assert verdict(ok) == []
    leak = {**ok, "slopes_per_min": {**ok["slopes_per_min"], "rss_mb": 2.0}}
    assert verdict(leak) == ["rss_mb grew +2.000/min (limit 1.5)"]
    assert len(verdict({**ok, "errors": 3, "error_rate": 0.001, "requests": 50})) == 2
