"""Roofline timing model of one continuous-batching step.

A step runs the whole batch through the model once, in two kinds of kernel that run one after
the other: the projections and MLP (GEMMs that stream the weights) and attention (which streams
the KV cache). Each is priced by its own roofline, and the step is their sum::

    max(GEMM FLOPs / (peak · MFU), weight bytes / (HBM bandwidth · efficiency))
      + max(attention FLOPs / (peak · MFU), KV bytes / (HBM bandwidth · efficiency))
      + step overhead + per-sequence overhead · sequences + tensor-parallel all-reduces

* GEMM FLOPs: ``2 · matmul_params`` per token processed (prefill chunk tokens and decode
  tokens), ``2 · vocab · hidden`` per sampled token (logits are computed only where a token is
  sampled). Attention FLOPs: causal ``4 · layers · heads · head_dim`` per (query, key) pair: a
  chunk of ``n`` new tokens after ``c`` cached ones has ``n·c + n(n+1)/2`` pairs.
* Bytes: the weights once per step (GEMMs); every scheduled sequence's KV cache, the context
  read and the new tokens' KV written (attention).
* Tensor parallelism divides FLOPs and bytes by the degree and adds two all-reduces per layer
  (latency plus the activations over the interconnect).
* Multiplicative seeded jitter (log-normal, a few percent) models run-to-run noise.

Why this shape: prefill is compute-bound and decode memory-bound on every GPU we model; a
step that mixes them (a prefill chunk beside a decode batch) pays for its compute-bound GEMMs
and its memory-bound decode attention in turn, which one roofline over the step's totals would
hide (measured on an H200: a 512-token chunk beside 32 decodes at 2,048 tokens of context took
18.6 ms of kernels, the totals' roofline says 14.2; see docs/calibration.md). The fixed per-step
cost (scheduling, sampling, kernel launches) is what makes an H200 decode only ~16% faster than
an H100 at small batch instead of the 30% its bandwidth suggests, and the per-sequence cost
reproduces the measured growth of step time with batch size.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from roofline.profiles import HardwareProfile, ModelProfile


@dataclass(frozen=True, slots=True)
class StepCost:
    """The modelled cost of one step, before jitter and time scaling."""

    flops: float
    bytes: float
    compute_s: float
    memory_s: float
    overhead_s: float
    kernel_s: float  # the GEMMs' roofline plus attention's (``compute_s``/``memory_s``: totals)

    @property
    def seconds(self) -> float:
        return self.kernel_s + self.overhead_s


class TimingModel:
    """Pure step-duration arithmetic for one (model, hardware) pair."""

    def __init__(
        self,
        model: ModelProfile,
        hardware: HardwareProfile,
        *,
        jitter: float = 0.03,
        seed: int = 0,
    ) -> None:
        self.model = model
        self.hardware = hardware
        self.jitter = jitter
        self._rng = random.Random(seed)
        tp = model.tensor_parallel
        self._flops_per_token = 2.0 * model.matmul_params / tp
        self._flops_per_sample = 2.0 * model.embedding_params / tp
        self._attn_flops_per_pair = 4.0 * model.num_layers * model.num_heads * model.head_dim / tp
        self._kv_bytes_per_token = model.kv_bytes_per_token / tp
        self._weight_bytes = model.weight_bytes / tp
        self._compute_rate = hardware.peak_flops * hardware.mfu
        self._memory_rate = hardware.hbm_bandwidth * hardware.mem_efficiency
        if tp > 1:
            ring = 2.0 * (tp - 1) / tp
            self._allreduce_fixed = 2 * model.num_layers * hardware.allreduce_latency_s
            self._allreduce_per_token = (
                2 * model.num_layers * model.hidden_size * model.dtype_bytes * ring
                / hardware.interconnect_bandwidth
            )
        else:
            self._allreduce_fixed = 0.0
            self._allreduce_per_token = 0.0

    def cost(self, work: Iterable[tuple[int, int]], num_sampled: int) -> StepCost:
        """Cost of a step computing, per sequence, ``(new_tokens, cached_context_tokens)``."""
        tokens = 0
        pairs = 0.0
        kv_tokens = 0
        seqs = 0
        for n, ctx in work:
            tokens += n
            pairs += n * ctx + n * (n + 1) / 2.0
            kv_tokens += ctx + n
            seqs += 1
        return self.aggregate(tokens, pairs, kv_tokens, seqs, num_sampled)

    def seconds(self, tokens: int, pairs: float, kv_tokens: int, seqs: int,
                num_sampled: int) -> float:
        """``aggregate(...).seconds`` without building the ``StepCost`` (the predictor's prior
        and the simulator's decode runs price steps by the million)."""
        if seqs == 0:
            return 0.0
        gemm, attn, kv = self._work(tokens, pairs, kv_tokens, num_sampled)
        return self._kernels(gemm, attn, kv) + self._overhead(tokens, seqs)

    def aggregate(self, tokens: int, pairs: float, kv_tokens: int, seqs: int,
                  num_sampled: int) -> StepCost:
        """The cost of a step given its totals: tokens computed, causal (query, key) pairs,
        KV tokens read or written, sequences and tokens sampled (what ``cost`` sums)."""
        if seqs == 0:
            return StepCost(0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
        gemm, attn, kv = self._work(tokens, pairs, kv_tokens, num_sampled)
        flops, nbytes = gemm + attn, self._weight_bytes + kv
        return StepCost(flops, nbytes, flops / self._compute_rate, nbytes / self._memory_rate,
                        self._overhead(tokens, seqs), self._kernels(gemm, attn, kv))

    def _work(self, tokens: int, pairs: float, kv_tokens: int, num_sampled: int
              ) -> tuple[float, float, float]:
        """(GEMM FLOPs, attention FLOPs, KV bytes) of a step."""
        return (self._flops_per_token * tokens + self._flops_per_sample * num_sampled,
                self._attn_flops_per_pair * pairs, self._kv_bytes_per_token * kv_tokens)

    def _kernels(self, gemm: float, attn: float, kv: float) -> float:
        """Seconds of kernels: the GEMMs' roofline (weights) plus attention's (KV cache)."""
        rc, rm = self._compute_rate, self._memory_rate
        return max(gemm / rc, self._weight_bytes / rm) + max(attn / rc, kv / rm)

    def _overhead(self, tokens: int, seqs: int) -> float:
        """The engine's fixed costs around the kernels and the tensor-parallel all-reduces."""
        hw = self.hardware
        return (hw.step_overhead_s + hw.per_seq_overhead_s * seqs + self._allreduce_fixed
                + self._allreduce_per_token * tokens)

    def step_seconds(self, work: Iterable[tuple[int, int]], num_sampled: int,
                     noise: Callable[[], float] | None = None) -> float:
        """Modelled duration of a step with seeded jitter applied (drawn by ``noise``, by
        default this model's own ``noise``: the simulator replays draws it kept)."""
        base = self.cost(work, num_sampled).seconds
        if self.jitter <= 0.0 or base == 0.0:
            return base
        return base * (noise or self.noise)()

    def noise(self) -> float:
        """The next step's jitter factor (one seeded draw; ``step_seconds`` takes the same)."""
        if self.jitter <= 0.0:
            return 1.0
        return math.exp(self._rng.gauss(0.0, self.jitter))

    def prefill_seconds(self, prompt_tokens: int, chunk: int) -> float:
        """Jitter-free time to prefill a lone prompt in chunks of ``chunk`` tokens (TTFT)."""
        total = 0.0
        done = 0
        while done < prompt_tokens:
            n = min(chunk, prompt_tokens - done)
            last = done + n >= prompt_tokens
            total += self.cost([(n, done)], 1 if last else 0).seconds
            done += n
        return total

    def decode_step_seconds(self, batch: int, context: int) -> float:
        """Jitter-free time of a decode step of ``batch`` sequences at ``context`` tokens each."""
        return self.cost([(1, context)] * batch, batch).seconds
