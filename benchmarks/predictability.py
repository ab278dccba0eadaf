"""How predictable were TTFT and TPOT in a run: decision-time knowledge against hindsight.

From a run's per-request client records (send time, TTFT, end, prompt and output tokens, the
endpoint that served it) this rebuilds, for every request, what a router could have known when
it sent the request and what only hindsight knows, fits the same small gradient-boosted model
to each feature set (log target, 5-fold cross-validation) and reports the mean absolute
percentage error each reaches, next to predicting the median for everything:

* TPOT. *At decision time*: the uncached prompt tokens queued at the endpoint (sent before,
  first token after), the sequences decoding there, the request's prompt and output lengths.
  *Hindsight*: the prefill tokens the endpoint actually computed while the request was
  decoding (from the other requests' prefill intervals) per second of its decode, and the mean
  number of sequences decoding beside it. On an aggregated endpoint with chunked prefill a
  decode step that shares a prefill chunk is several times longer, so TPOT is set by prefill
  work that arrives *after* the decision; if hindsight predicts TPOT far better than decision
  time does, the gap is not a modelling failure.
* TTFT. *At decision time*: the same queue, decoders and prompt. *Hindsight*: how long after
  the send the prefills queued ahead actually finished (what a perfect queue model would know);
  *hindsight with arrivals* adds the prompt tokens sent to the same endpoint while this prompt
  was being computed. With chunked prefill a step packs every prompt waiting for it up to the
  token budget, so a prompt arriving during this one's prefill fills its last, partial chunk
  step and lengthens it: TTFT, too, depends on work that arrives after the decision.

Times are the client's, so they include the gateway's and the client's own delays: the
hindsight figure is an upper bound on what any predictor could reach in the same run.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import xgboost as xgb

from loadtests.client import RequestResult

Array = npt.NDArray[np.float64]


def _cv_mape(x: Array, y: Array, folds: int = 5, seed: int = 0) -> float:
    idx = np.random.default_rng(seed).permutation(len(y))
    errors = []
    for part in np.array_split(idx, folds):
        train = np.setdiff1d(idx, part)
        booster = xgb.train({"max_depth": 3, "eta": 0.05, "min_child_weight": 10,
                             "verbosity": 0}, xgb.DMatrix(x[train], label=np.log(y[train])), 300)
        pred = np.exp(booster.predict(xgb.DMatrix(x[part])))
        errors.append(np.abs(pred - y[part]) / y[part])
    return float(np.concatenate(errors).mean())


def bounds(results: Sequence[RequestResult], started_at: float, warmup_s: float = 0.0,
           min_output: int = 8) -> dict[str, Any]:
    done = [r for r in results if r.ok and r.ttft is not None and r.latency is not None
            and r.endpoint is not None and r.output_tokens >= 2]
    if len(done) < 50:
        return {"error": f"only {len(done)} completed requests"}
    sent = np.array([r.sent_at - started_at for r in done])
    first = sent + np.array([r.ttft or 0.0 for r in done])
    last = sent + np.array([r.latency or 0.0 for r in done])
    uncached = np.array([float(r.prompt_tokens - r.cached_tokens) for r in done])
    out = np.array([float(r.output_tokens) for r in done])
    tpot = (last - first) / np.maximum(out - 1, 1) * 1e3
    ttft = (first - sent) * 1e3
    endpoint = np.array([r.endpoint for r in done])
    # where each prompt was computed: the prefill endpoint of a disaggregated pool, if any
    prefilled = np.array([r.prefill_endpoint or r.endpoint for r in done])
    n = len(done)
    queued, decoding, prompt_rate, beside, ahead_done, arrived = (np.zeros(n) for _ in range(6))
    for i in range(n):
        # prompts computed where this one was (its queue), and where it decodes
        pre = prefilled == prefilled[i]
        pre[i] = False
        ps, pf = sent[pre], first[pre]
        q = (ps <= sent[i]) & (pf > sent[i])
        queued[i] = uncached[pre][q].sum()
        ahead_done[i] = max(pf[q].max() - sent[i], 0.0) * 1e3 if q.any() else 0.0
        arrived[i] = uncached[pre][(ps > sent[i]) & (ps < first[i])].sum()
        dec = endpoint == endpoint[i]
        dec[i] = False
        ds, df = first[dec], last[dec]
        decoding[i] = ((ds <= sent[i]) & (df > sent[i])).sum()
        window = max(last[i] - first[i], 1e-3)
        here = prefilled[dec] == endpoint[i]  # prompts computed on the decoding endpoint
        ps, pf = sent[dec][here], first[dec][here]
        overlap = np.clip(np.minimum(pf, last[i]) - np.maximum(ps, first[i]), 0.0, None)
        prompt_rate[i] = (overlap / np.maximum(pf - ps, 1e-3)
                          * uncached[dec][here]).sum() / window
        beside[i] = np.clip(np.minimum(df, last[i]) - np.maximum(ds, first[i]), 0.0,
                            None).sum() / window
    keep = sent >= warmup_s
    t_keep = keep & (out >= min_output)

    def median_mape(y: Array) -> float:
        return float((np.abs(np.median(y) - y) / y).mean())

    y = tpot[t_keep]
    tp = {"n": int(t_keep.sum()), "median_only": median_mape(y),
          "decision_time": _cv_mape(np.column_stack([queued, decoding, uncached, out])[t_keep],
                                    y),
          "hindsight": _cv_mape(np.column_stack([prompt_rate, beside, uncached, out])[t_keep],
                                y),
          "corr_with_prefill_during_decode": (
              float(np.corrcoef(prompt_rate[t_keep], y)[0, 1])
              if prompt_rate[t_keep].std() > 0 else None)}
    y = ttft[keep]
    tt = {"n": int(keep.sum()), "median_only": median_mape(y),
          "decision_time": _cv_mape(np.column_stack([queued, uncached, decoding])[keep], y),
          "hindsight": _cv_mape(np.column_stack([ahead_done, uncached, decoding])[keep], y),
          "hindsight_with_arrivals": _cv_mape(
              np.column_stack([ahead_done, uncached, decoding, arrived])[keep], y)}
    return {"tpot": tp, "ttft": tt}
