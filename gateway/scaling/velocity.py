"""Token velocity (TokenScale): per pool and stage, the token rate arriving against the token
rate the pool can process now, and the replicas each role needs to keep up.

Stages: ``prefill`` (compute-bound: uncached prompt tokens), ``decode`` (memory-bandwidth
bound: output tokens), ``transfer`` (network-bound: KV of prompts prefilled on one instance
and decoded on another; disaggregated pools only).

*Demand* is measured where requests are admitted, before they queue anywhere: each admitted
request adds its prompt tokens (prefill, and transfer in a disaggregated pool) and its expected
output tokens (decode) to exponentially decayed rates (``tau_s``), so a burst shows up in the
demand at once, while lagging signals (queue length, GPU utilization) would show it only after
the queues formed.

*Capacity* of one endpoint per stage, in tokens/s: from the model and hardware profile with
the backend's roofline timing (prefill: a full chunk of ``max_num_batched_tokens`` per step;
decode: a batch of ``decode_batch`` sequences at ``decode_context`` tokens each; transfer:
link bandwidth over KV bytes per token), replaced by the rate observed at the endpoint when the
gateway has measured one (``EndpointState.prefill_rate``).

*Desired replicas* for a role: ceil(demand / (capacity x target utilization)) summed over the
stages the role serves, at least ``min_replicas`` (0 when idle) and at most ``max_replicas``.
In a disaggregated pool with convertible decoders, prefill gets only what the decoders' spare
time (they prefill once converted) leaves: ceil(prefill + decode) - decoders.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from roofline.profiles import HARDWARE, MODELS
from roofline.timing import TimingModel

STAGES = ("prefill", "decode", "transfer")
DEFAULT_LINK_BPS = 400e9  # RDMA, as the reference backend's default KV link


class DecayingRate:
    """Events per second, exponentially weighted over ``tau_s`` (exact for a steady rate).

    Bias-corrected while young: a meter that started (or restarted after ``5 tau`` without
    events) ``t`` seconds ago divides by ``1 - exp(-t / tau)``, the share of a steady rate its
    mass has reached by then, so a step in arrivals from idle reads at its full size within
    ``min_window_s`` instead of creeping up over several ``tau`` (Adam's bias correction; a
    pool waking into a burst would otherwise launch its replicas seconds late)."""

    def __init__(self, tau_s: float = 5.0, clock: Callable[[], float] = time.monotonic,
                 min_window_s: float = 1.0) -> None:
        self.tau_s = tau_s
        self.min_window_s = min_window_s
        self._clock = clock
        self._mass = 0.0
        self._at = clock()
        self._since: float | None = None  # when the current run of events began

    def add(self, amount: float) -> None:
        now = self._clock()
        if self._since is None or now - self._at > 5.0 * self.tau_s:
            self._since = now
        self._mass = self._mass * math.exp(-(now - self._at) / self.tau_s) + amount
        self._at = now

    def rate(self) -> float:
        if self._since is None:
            return 0.0
        now = self._clock()
        age = max(now - self._since, self.min_window_s)
        reached = 1.0 - math.exp(-age / self.tau_s)
        return self._mass * math.exp(-(now - self._at) / self.tau_s) / self.tau_s / reached


@dataclass(frozen=True, slots=True)
class Capacity:
    """Tokens per second one endpoint processes in each stage."""

    prefill: float
    decode: float
    transfer: float

    def of(self, stage: str) -> float:
        return float(getattr(self, stage))


def profile_capacity(model: str, hardware: str, *, max_num_batched_tokens: int = 8192,
                     decode_batch: int = 64, decode_context: int = 2048,
                     link_bps: float = DEFAULT_LINK_BPS) -> Capacity:
    """An endpoint's per-stage capacity from the reference backend's timing model."""
    m, hw = MODELS[model], HARDWARE[hardware]
    t = TimingModel(m, hw, jitter=0.0)
    chunk = max_num_batched_tokens
    prefill = chunk / t.prefill_seconds(chunk, chunk)
    decode = decode_batch / t.decode_step_seconds(decode_batch, decode_context)
    transfer = link_bps / 8.0 / m.kv_bytes_per_token
    return Capacity(prefill, decode, transfer)


class Velocity:
    """One pool's demand meters and the arithmetic that turns them into replica counts."""

    def __init__(self, capacity: Capacity, *, disaggregated: bool = False, tau_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.capacity = capacity
        self.disaggregated = disaggregated
        self.demand = {s: DecayingRate(tau_s, clock) for s in STAGES}
        self._clock = clock
        self.last_request_at = -math.inf

    def admitted(self, prompt_tokens: int, output_tokens: int) -> None:
        """A request was admitted to the pool: its tokens are demand from now on."""
        self.demand["prefill"].add(prompt_tokens)
        self.demand["decode"].add(output_tokens)
        if self.disaggregated:
            self.demand["transfer"].add(prompt_tokens)
        self.last_request_at = self._clock()

    def rates(self) -> dict[str, float]:
        return {s: self.demand[s].rate() for s in STAGES}

    def needed(self, stage: str, utilization: float, capacity: float | None = None) -> float:
        """Endpoints the stage needs (fractional): demand / (capacity x utilization)."""
        cap = capacity if capacity is not None else self.capacity.of(stage)
        return self.demand[stage].rate() / max(cap * utilization, 1e-9)

    def desired(self, utilization: float, *, prefill_capacity: float | None = None,
                convertible: bool = False) -> dict[str, int]:
        """Replicas per role: an aggregated pool's ``both``, or ``prefill`` and ``decode``.

        With ``convertible`` decoders (TokenScale), the decoders' spare time counts as prefill
        capacity: a converted decoder prefills while it keeps decoding, so prefill instances
        are provisioned only for what the decoders (at least one) cannot absorb."""
        p = self.needed("prefill", utilization, prefill_capacity)
        d = self.needed("decode", utilization)
        if not self.disaggregated:
            # One instance does both: the stages share its time.
            return {"both": math.ceil(p + d - 1e-9)}
        # Transfer is network-bound on the decode side's links (it pulls the KV).
        dec = max(d, self.needed("transfer", utilization))
        n_dec = math.ceil(dec - 1e-9)
        if convertible:
            n_pre = max(math.ceil(p + dec - 1e-9) - max(n_dec, 1), 0)
        else:
            n_pre = math.ceil(p - 1e-9)
        return {"prefill": n_pre, "decode": n_dec}
