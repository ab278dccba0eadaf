"""The predictor's prior: a roofline estimate of a candidate's TTFT and TPOT from the
endpoint's model and hardware profile, right from the first request.

A request sent to an endpoint waits for the prefill queued ahead of it there, then its own
uncached tokens; both are computed in chunked-prefill steps of ``budget − decoding`` tokens
that share each step with the decoding sequences, and a step's duration is the reference
backend's own roofline (``roofline.timing.TimingModel.aggregate``: compute- or memory-bound,
plus the engine's fixed and per-sequence costs). The queue ahead is the gateway's exact live
count of uncached tokens sent there and not yet answered, less what the head of that queue
has likely computed since it started (the gateway's virtual prefill queue,
``gateway.routing.endpoints.LiveLoad.prefill_queue_ms``). Subtracting instead what the engine could
have computed since the *oldest* pending request was sent counted the same time twice (it
also went to prefills already answered) and routed worse in the strategy matrix. Its TPOT
is a decode step of the batch it joins, stretched
by the prefill work that keeps arriving there (steps carry those chunks too): in a second the
GPU spends ``arrivals × per-token prefill time`` on prefill and the rest on decode steps.

What the roofline does not know (engine overheads, contention, the arrivals of the next
seconds) the learned model corrects: it is trained on log(actual / prior), so a fresh gateway
predicts the prior and a trained one the prior times a learned factor. Endpoints of unknown
hardware (a real vLLM the policy says nothing about) get no roofline: their prior is the
calibrated estimate of ``predictor.analytic``, from the prefill rate and decode step the
gateway observes there.
"""

from __future__ import annotations

from roofline.profiles import HardwareProfile, ModelProfile
from roofline.timing import TimingModel

FIXED_MS = 1.0  # gateway and network before the engine sees the request, and back


class RooflinePrior:
    def __init__(self, model: ModelProfile, hardware: HardwareProfile, budget: int) -> None:
        self.timing = TimingModel(model, hardware, jitter=0.0)
        self.budget = max(budget, 16)

    def _step_s(self, prefill: float, ctx_p: float, decodes: float, ctx_d: float) -> float:
        seqs = decodes + (1 if prefill > 0 else 0)
        if seqs <= 0:
            return 0.0
        pairs = prefill * ctx_p + prefill * (prefill + 1) / 2.0 + decodes * ctx_d
        kv = ctx_p + prefill + decodes * (ctx_d + 1) if prefill > 0 else decodes * (ctx_d + 1)
        return self.timing.seconds(int(prefill + decodes), pairs, int(kv), int(seqs),
                                   int(decodes + (1 if prefill > 0 else 0)))

    def estimate(self, prompt: int, uncached: int, output: int, decoding: float,
                 queued_tokens: float, arrivals_per_s: float, role: str,
                 decode_context: float | None = None) -> tuple[float, float]:
        """(TTFT ms, TPOT ms) of a request sent to this endpoint now, ``queued_tokens`` of
        prefill ahead of it, ``decoding`` sequences there of ``decode_context`` tokens on
        average (unknown: this request's own length)."""
        d = max(decoding, 0.0)
        chunk = max(self.budget - d, self.budget / 4.0)
        cached = prompt - uncached
        ctx_p = cached + uncached / 2.0
        own = prompt + output / 2.0
        ctx_d = own if decode_context is None else decode_context
        step = self._step_s(chunk, ctx_p, d, ctx_d)
        ahead = max(queued_tokens, 0.0)
        work = ahead + uncached
        if work <= chunk:
            ttft = self._step_s(max(work, 1.0), ctx_p, d, ctx_d)
        else:
            ttft = work / chunk * step
        if d > 0 or ahead > 0:  # the step under way finishes first, on average half of it
            ttft += 0.5 * self._step_s(0.0, 0.0, d, ctx_d) if ahead <= 0 else 0.5 * step
        joined = (d * ctx_d + own) / (d + 1.0)
        decode = self._step_s(0.0, 0.0, d + 1.0, joined)
        per_token = max(self._step_s(chunk, ctx_p, d + 1.0, joined) - decode, 0.0) / chunk
        load = 0.0 if role == "decode" else min(arrivals_per_s * per_token, 0.9)
        return ttft * 1e3 + FIXED_MS, decode / (1.0 - load) * 1e3
