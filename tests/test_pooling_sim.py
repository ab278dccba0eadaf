"""Many models on a shared fleet, simulated: the long-tail workload, placement by token
velocity, the three pooling modes on the same arrivals, and ``simulate``/``plan
--pooling``'s outputs."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from gateway.routing.placement import InstanceView, pick, placement, read_residency
from roofline.profiles import HARDWARE, MODELS
from simulator.causes import TPOT_CAUSES, TTFT_CAUSES
from simulator.longtail import ModelRequest, from_jsonl, longtail
from simulator.multimodel import FleetConfig, run_fleet

ROOT = Path(__file__).resolve().parent.parent


def test_the_long_tail_is_zipf_and_bursty_and_seeded() -> None:
    reqs = longtail(16, 4.0, 600, seed=3)
    counts = Counter(r.model for r in reqs)
    assert counts["m00"] > 3 * counts["m08"]  # popularity falls with rank
    assert 0.7 * 2400 < len(reqs) < 1.3 * 2400  # 4 req/s for 600 s, give or take bursts
    assert [(r.model, r.t) for r in reqs] == [(r.model, r.t) for r in longtail(16, 4.0, 600,
                                                                                 seed=3)]
    assert all(reqs[i].t <= reqs[i + 1].t for i in range(len(reqs) - 1))
    # each model's window opens at a random instant: no burst of every model's first request
    firsts = {m: min(r.t for r in reqs if r.model == m) for m in counts}
    assert len(set(firsts.values())) == len(firsts) and min(firsts.values()) > 0


def test_a_trace_names_a_model_per_row(tmp_path: Path) -> None:
    f = tmp_path / "t.jsonl"
    f.write_text('{"t": 5, "model": "a", "input_tokens": 10, "output_tokens": 3}\n\n'
                 '{"t": 6, "input_tokens": 20, "output_tokens": 4}\n')
    reqs = from_jsonl(f, "base")
    assert [(r.model, r.t, r.prompt_tokens) for r in reqs] == [("a", 0.0, 10), ("base", 1.0, 20)]
    f.write_text('{"t": 5, "model": "a", "input_tokens": 0, "output_tokens": 3}\n')
    with pytest.raises(ValueError, match=":1: token counts"):
        from_jsonl(f, "base")


def test_a_public_trace_with_a_model_per_row_is_read_in_its_own_format(tmp_path: Path) -> None:
    """Mooncake's JSONL (timestamp in ms, input_length, output_length, hash_ids) and an Azure
    LLM CSV, each with a ``model`` field added, as ``plan --pooling --trace`` reads them."""
    from simulator.longtail import from_trace

    f = tmp_path / "m.jsonl"
    f.write_text('{"timestamp": 2000, "input_length": 9000, "output_length": 300, '
                 '"hash_ids": [1, 2], "model": "m7"}\n'
                 '{"timestamp": 500, "input_length": 100, "output_length": 5, "hash_ids": []}\n')
    reqs = from_trace(f, "base")
    assert [(r.model, r.t, r.prompt_tokens, r.output_tokens) for r in reqs] == [
        ("base", 0.0, 100, 5), ("m7", 1.5, 9000, 300)]
    c = tmp_path / "a.csv"
    c.write_text("TIMESTAMP,ContextTokens,GeneratedTokens,model\n"
                 "2023-11-16 18:15:46.6805900,4808,10,m1\n"
                 "2023-11-16 18:15:50.9951690,3180,8,\n")
    reqs = from_trace(c, "base")
    assert [(r.model, r.prompt_tokens) for r in reqs] == [("m1", 4808), ("base", 3180)]
    assert reqs[1].t == pytest.approx(4.3145790)
    f.write_text('{"timestamp": 1, "input_length": "x", "output_length": 3}\n')
    with pytest.raises(ValueError, match="input_length"):
        from_trace(f, "base")


def test_placement_follows_token_velocity_and_gives_every_model_a_home() -> None:
    v = {"hot": 1000.0, "warm": 100.0, **{f"cold{i}": 1.0 for i in range(6)}}
    hosts = placement(v, 4, 3)
    flat = Counter(m for h in hosts for m in h)
    assert set(flat) == set(v) and all(len(h) <= 3 for h in hosts)
    assert flat["hot"] == 4 and flat["hot"] >= flat["warm"] >= flat["cold0"] == 1
    assert placement({"a": 1.0, "b": 1.0}, 2, 1) in ([["a"], ["b"]], [["b"], ["a"]])
    with pytest.raises(ValueError, match="do not fit"):
        placement({f"m{i}": 1.0 for i in range(5)}, 2, 2)


def test_routing_prefers_where_the_model_waits_least() -> None:
    a = InstanceView("a", frozenset({"x", "y"}), frozenset({"y"}), {"x": 0.8, "y": 0.0}, 0.1)
    b = InstanceView("b", frozenset({"x"}), frozenset({"x"}), {"x": 0.0}, 0.5)
    assert pick("x", [a, b]) is b and pick("y", [a, b]) is a and pick("z", [a, b]) is None
    text = ('tokengate_backend_model_wait_seconds{engine="0",model_name="x"} 0.33\n'
            'tokengate_backend_model_resident{engine="0",model_name="x"} 0.0\n'
            'tokengate_backend_model_resident{engine="0",model_name="y"} 1.0\n')
    assert read_residency(text) == ({"x": 0.33}, frozenset({"y"}))


def test_the_path_to_the_engine_delays_arrival_and_delivery_not_the_engines_work() -> None:
    """``path_in_s``/``path_out_s`` (the client's, the gateway's and the HTTP path's fixed
    cost, measured by ``benchmarks.sim_models_confirm``): a lone request's TTFT grows by
    both, its TPOT not at all; a request whose engine time alone fits the TTFT SLO but not
    with the path misses it."""
    h100, llama = HARDWARE["h100-sxm"], MODELS["llama-3-8b"]
    one = [ModelRequest(0, "m0", 1.0, 6000, 20)]
    bare = run_fleet(one, FleetConfig(1, "token", llama, h100, jitter=0.0)).requests[0]
    cfg = FleetConfig(1, "token", llama, h100, jitter=0.0, path_in_s=0.004, path_out_s=0.002)
    pathed = run_fleet(one, cfg).requests[0]
    assert bare.ttft is not None and pathed.ttft is not None
    assert pathed.ttft == pytest.approx(bare.ttft + 0.006, abs=1e-9)
    assert pathed.tpot == pytest.approx(bare.tpot, abs=1e-12)
    tight = FleetConfig(1, "token", llama, h100, jitter=0.0, ttft_slo_s=bare.ttft + 0.003,
                        path_in_s=0.004, path_out_s=0.002)
    assert bare.meets(bare.ttft + 0.003, 1.0)
    late = run_fleet(one, tight)
    assert not late.requests[0].meets(tight.ttft_slo_s, 1.0)
    assert late.instances[0].misses[0] == 1  # counted as the engine's deadline passed


def test_every_requests_time_is_put_down_to_its_causes_exactly() -> None:
    """``simulator.causes``: on a pooled fleet each request's TTFT is the sum of its causes
    plus the way back to the client, and its decode time the sum of its decode causes; the
    summary reports them per request and over the missed ones."""
    reqs = longtail(8, 2.0, 120, seed=3)
    cfg = FleetConfig(2, "token", MODELS["llama-3-8b"], HARDWARE["h100-sxm"],
                      path_in_s=0.003, path_out_s=0.002)
    res = run_fleet(reqs, cfg)
    done = [r for r in res.requests if r.done is not None]
    assert len(done) == len(reqs)
    for r in done:
        assert r.ttft is not None and r.first_token is not None
        waited = sum(v for k, v in r.lost.items() if k in TTFT_CAUSES)
        decoded = sum(v for k, v in r.lost.items() if k in TPOT_CAUSES)
        assert waited + 0.002 == pytest.approx(r.ttft, abs=1e-9)
        assert decoded == pytest.approx(r.done - r.first_token, abs=1e-9)
        assert r.lost["path"] == pytest.approx(0.003)
    summary = res.summary(2.0, 0.05)["causes_ms"]
    assert set(summary["all"]) == set(TTFT_CAUSES) | {c + "_per_token" for c in TPOT_CAUSES}
    assert summary["all"]["switch"] > 0 and summary["all"]["other_decode"] > 0


def test_a_long_prompt_of_one_model_is_charged_to_the_others_waiting_behind_it() -> None:
    """One instance, two resident models: a 30K-token prompt of m0, then a short one of m1
    arriving during its prefill: m1's request waits on m0's prompt chunk under way
    (``other_prefill``), not on its own model's queue; m0's prefill, chunked, then waits on
    m1's steps, which token-level sharing puts between its chunks."""
    reqs = [ModelRequest(0, "m0", 0.0, 30_000, 10), ModelRequest(1, "m1", 0.05, 100, 10),
            ModelRequest(2, "m1", 5.0, 100, 2)]  # m1's later request keeps it a home
    res = run_fleet(reqs, FleetConfig(1, "token", MODELS["llama-3-8b"], HARDWARE["h100-sxm"],
                                      per_instance=2, jitter=0.0))
    short = res.requests[1]
    assert short.lost.get("other_prefill", 0.0) > 0.1
    assert short.lost.get("own_queue", 0.0) == 0.0
    long = res.requests[0].lost
    assert long.get("other_prefill", 0.0) + long.get("other_decode", 0.0) > 0.0
    assert long["own_prefill"] > 1.0


def test_a_disaggregated_fleet_prefills_on_one_group_and_decodes_on_the_other() -> None:
    """``prefill_instances``: the first instances only prefill, the rest only decode. Every
    request is prefilled on a prefill instance, its KV crosses the link (``transfer``: latency
    plus the prompt's KV bytes over the bandwidth), and its tokens come from a decode
    instance, which computes only the last prompt token; its TTFT is still the sum of its
    causes. The two groups each host every model."""
    reqs = longtail(6, 2.0, 90, seed=5)
    llama = MODELS["llama-3-8b"]
    cfg = FleetConfig(4, "token", llama, HARDWARE["h100-sxm"], prefill_instances=2,
                      per_instance=6, path_in_s=0.003, path_out_s=0.002)
    res = run_fleet(reqs, cfg)
    pre, dec = res.instances[:2], res.instances[2:]
    assert all(i.handoff is not None and not i.decodes for i in pre)
    assert all(i.handoff is None and i.decodes for i in dec)
    assert {m for h in res.hosts[:2] for m in h} == {m for h in res.hosts[2:] for m in h} == {
        r.model for r in reqs}
    done = [r for r in res.requests if r.done is not None]
    assert len(done) == len(reqs)
    for r in done:
        assert r.instance in {"i2", "i3"} and r.tokens == r.output_tokens
        link = cfg.kv_link_latency_s + r.prompt_tokens * llama.kv_bytes_per_token * 8 \
            / cfg.kv_link_bps
        assert r.lost["transfer"] == pytest.approx(link)
        waited = sum(v for k, v in r.lost.items() if k in TTFT_CAUSES)
        assert waited + 0.002 == pytest.approx(r.ttft, abs=1e-9)
    s = res.summary(2.0, 0.05)
    assert s["prefill_instances"] == 2 and s["completed"] == len(reqs)
    missed = sum(not r.meets(2.0, 0.05) for r in res.requests)
    assert s["ttft_misses"] + s["tpot_misses"] == missed
    assert 0 <= s["ttft_misses_in_prefill"] <= s["ttft_misses"]
    assert all(r.prefilled is not None and r.t < r.prefilled < (r.first_token or 0) for r in done)
    with pytest.raises(ValueError, match="at least one prefill and one decode"):
        FleetConfig(2, "token", llama, HARDWARE["h100-sxm"], prefill_instances=2)


def test_the_planner_searches_the_split_toward_the_side_that_misses() -> None:
    """``fewest_gpus(split=True)``: each size starts at the prefill's share of the work and
    moves one instance toward the side whose SLO broke; every trial says its split."""
    from simulator.sizing import fewest_gpus, prefill_fraction

    reqs = longtail(4, 2.0, 60, seed=4)
    base = FleetConfig(1, "token", MODELS["llama-3-8b"], HARDWARE["h100-sxm"])
    share = prefill_fraction(reqs, base)
    assert 0.0 < share < 1.0
    long = [ModelRequest(r.rid, r.model, r.t, r.prompt_tokens * 20, r.output_tokens)
            for r in reqs]
    assert prefill_fraction(long, base) > share  # longer prompts: more of the work
    best, trials = fewest_gpus(reqs, base, 0.95, 6, split=True)
    assert best is not None and best >= 2
    assert all(1 <= t["prefill_instances"] < t["instances"] for t in trials)
    assert any(t["instances"] == best and t["attainment"] >= 0.95 for t in trials)


def test_token_pooling_holds_the_slo_where_request_pooling_cannot() -> None:
    """The same 8-model long tail on 2 GPUs: switching between steps by deadline keeps
    ~all requests within TTFT 2 s / TPOT 50 ms; switching only when a batch drains leaves
    requests of other models queued behind whole batches."""
    reqs = longtail(8, 2.0, 240, seed=8)
    h100, llama = HARDWARE["h100-sxm"], MODELS["llama-3-8b"]
    token = run_fleet(reqs, FleetConfig(2, "token", llama, h100)).summary(2.0, 0.05)
    request = run_fleet(reqs, FleetConfig(2, "request", llama, h100)).summary(2.0, 0.05)
    dedicated = run_fleet(reqs, FleetConfig(8, "dedicated", llama, h100)).summary(2.0, 0.05)
    assert dedicated["attainment"] >= 0.99 and dedicated["switches"] == 0
    assert token["attainment"] >= 0.95
    assert request["attainment"] < token["attainment"] - 0.1
    assert token["completed"] == request["completed"] == len(reqs)


def test_simulate_and_plan_with_pooling_write_their_reports(tmp_path: Path) -> None:
    common = ["--pooling", "token", "--longtail", "6", "--rate", "1.5", "--duration", "90"]
    sim = subprocess.run([sys.executable, "-m", "tokengate", "simulate", *common,
                          "--backends", "2", "--out", str(tmp_path / "sim")],
                         capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert sim.returncode == 0, sim.stderr
    rep = json.loads((tmp_path / "sim" / "report.json").read_text())
    assert rep["gpus"] == 2 and rep["models"] == 6 and set(rep["per_model"]) == {
        f"m{i}" for i in range(6)}
    pd = subprocess.run([sys.executable, "-m", "tokengate", "simulate", *common,
                         "--backends", "3", "--prefill-instances", "1", "--out",
                         str(tmp_path / "pd")], capture_output=True, text=True, cwd=ROOT,
                        timeout=300)
    assert pd.returncode == 0, pd.stderr
    rep = json.loads((tmp_path / "pd" / "report.json").read_text())
    assert rep["prefill_instances"] == 1 and rep["utilisation_prefill"] > 0 \
        and rep["utilisation_decode"] > 0 and rep["causes_ms"]["all"]["transfer"] > 0
    plan = subprocess.run([sys.executable, "-m", "tokengate", "plan", *common, "--model",
                           "llama-3-8b", "--hardware", "h100-sxm", "--max-gpus", "4",
                           "--target-goodput", "0.95", "--disaggregate", "--out",
                           str(tmp_path / "plan")],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert plan.returncode == 0, plan.stderr
    doc = json.loads((tmp_path / "plan" / "plan.json").read_text())
    rec = doc["recommended_gpus"]
    assert isinstance(rec, int) and 1 <= rec <= 4
    by_size = {t["instances"]: t["attainment"] for t in doc["trials"]}
    agg = doc["aggregated_gpus"]
    assert by_size[agg] >= 0.95 and all(a < 0.95 for n, a in by_size.items() if n < agg)
    # prefill and decode instances searched beside it; the fewer GPUs recommended
    split = doc["disaggregated_trials"]
    assert split and all(1 <= t["prefill_instances"] < t["instances"] for t in split)
    assert rec == min(g for g in (agg, doc["disaggregated_gpus"]) if g is not None)
    assert doc["layout"] == ("aggregated" if rec == agg else "disaggregated")
    assert "aggregated:" in plan.stdout and "prefill/decode:" in plan.stdout
    # the perfect-foresight bound beside it, and the report a person reads
    bound = doc["bound_gpus"]
    assert isinstance(bound, int) and 1 <= bound <= rec
    md = (tmp_path / "plan" / "plan.md").read_text()
    assert f"Recommended: **{rec} GPU(s)**" in md and f"bound: **{bound} GPU(s)**" in md
    assert "| token, prefill/decode |" in md and "prefill and decode instances" in md
    assert (tmp_path / "plan" / "plan.png").stat().st_size > 1000
    for t in doc["trials"] + doc["bound_trials"] + split:  # cut short: never read as a pass
        if t["stopped_early"]:
            assert "stopped early (attainment at most" in plan.stdout
            assert t["attainment"] < 0.95
    assert "perfect-foresight bound:" in plan.stdout
    bad = subprocess.run([sys.executable, "-m", "tokengate", "simulate", "--pooling", "token",
                          "--out", str(tmp_path / "x")], capture_output=True, text=True,
                         cwd=ROOT, timeout=60)
    assert bad.returncode == 2 and "--longtail" in bad.stderr
