"""The prior of every prediction: the roofline of ``predictor.prior`` where the router gave one
(the ``prior_*`` columns), else a queueing estimate from first principles (below).

TTFT is the time to prefill everything queued ahead plus this request's uncached tokens at the
endpoint's prefill rate, plus a fixed latency; TPOT is one decode step, which grows with the
batch (or, where streams are decoding, the step the gateway currently measures there). Rates
default to a Llama-3-8B class model on an H100 (prefill ~ 35K tokens/s, a decode step ~ 7.8 ms
at batch 1 plus ~ 60 µs per sequence) and scale with the hardware features when they are
known. Good to within a small factor, which is all a cold start needs: the learned
model replaces it as soon as there are enough samples.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from predictor.features import F

PREFILL_MS_PER_TOKEN = 1000.0 / 35_000.0
TTFT_BASE_MS = 12.0
STEP_MS = 7.8
STEP_MS_PER_SEQ = 0.06
_H100_TBS, _H100_TFLOPS = 3.35, 989.0


def predict_ttft_ms(x: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    tflops = np.where(x[:, F["hw_tflops"]] > 0, x[:, F["hw_tflops"]], _H100_TFLOPS)
    per_token = PREFILL_MS_PER_TOKEN * _H100_TFLOPS / tflops
    queued = x[:, F["prefill_tokens"]] + x[:, F["uncached_tokens"]]
    # Waiting requests the gateway did not send itself (other clients) cost ~ a prompt each.
    others = np.maximum(x[:, F["waiting"]] - x[:, F["in_flight"]], 0.0) * x[:, F["prompt_tokens"]]
    busy = (x[:, F["decoding"]] + x[:, F["running"]]) * STEP_MS_PER_SEQ
    out: npt.NDArray[np.float64] = TTFT_BASE_MS + (queued + others) * per_token + busy \
        + x[:, F["load_ms"]]  # the prefix in lower KV tiers: loaded, not computed
    prior = x[:, F["prior_ttft_ms"]]
    return np.where(prior > 0, prior, out)


def predict_tpot_ms(x: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    bw = np.where(x[:, F["hw_bandwidth_tbs"]] > 0, x[:, F["hw_bandwidth_tbs"]], _H100_TBS)
    batch = np.maximum(x[:, F["running"]], x[:, F["decoding"]]) + 1.0
    step = (STEP_MS * _H100_TBS / bw) + STEP_MS_PER_SEQ * batch
    # Prefill work queued on the same endpoint stretches decode steps (chunked prefill).
    step += x[:, F["prefill_tokens"]] * PREFILL_MS_PER_TOKEN * 0.05
    # Where streams decode there now, their measured step is the better estimate.
    out: npt.NDArray[np.float64] = np.where(x[:, F["step_ms"]] > 0, x[:, F["step_ms"]], step)
    prior = x[:, F["prior_tpot_ms"]]
    return np.where(prior > 0, prior, out)
