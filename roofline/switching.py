"""What it costs an instance to switch the model it runs: the weights' transfer to the GPU.

A model's weights live in host memory (pinned, as a model pool keeps them) or on local disk.
Bringing them in takes ``weight bytes per GPU / bandwidth`` plus a fixed overhead:

- ``optimised`` (Aegaeon, SOSP 2025): the engine is not re-initialised between models (its
  components, CUDA context and memory pools are reused and the weights land in preallocated
  buffers), so the switch is the copy plus ``optimised_overhead_s``. Aegaeon reports this cuts
  the cost of a switch by 97 % against re-initialising an engine, to well under a second.
- ``naive``: every switch also re-initialises the engine (``reinit_overhead_s``): what a
  request-level auto-scaler without those optimisations pays.

Bandwidths: host memory reaches the GPU over PCIe (``HardwareProfile.pcie_bandwidth``, 50 GB/s
for Gen5 x16 with pinned copies); disk at ``disk_bandwidth`` (a local NVMe Gen4 drive, 6 GB/s
sequential read). Dropping a model's weights costs nothing: the host keeps the copy. The KV of
a switched-out model stays on the GPU while memory allows; when it must go it is dropped and
recomputed, never swapped, so switches never wait on KV copies.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from roofline.profiles import HardwareProfile, ModelProfile

Source = Literal["host", "disk"]
SOURCES: tuple[Source, ...] = ("host", "disk")


@dataclass(frozen=True, slots=True)
class SwitchCost:
    """How an instance brings a model's weights onto its GPUs."""

    source: Source = "host"
    optimised: bool = True
    disk_bandwidth: float = 6e9  # bytes/s, per GPU
    optimised_overhead_s: float = 0.010
    reinit_overhead_s: float = 2.5
    # perfect foresight (a benchmark's bound): every load was started ahead of the requests
    # that need it, overlapped with other models' steps, so it costs the GPU no time; the
    # scheduler still weighs each load as it would
    prefetched: bool = False

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise ValueError(f"weights source must be one of {', '.join(SOURCES)}, "
                             f"not {self.source!r}")
        if self.disk_bandwidth <= 0:
            raise ValueError("disk_bandwidth must be positive")

    def bandwidth(self, hw: HardwareProfile) -> float:
        return hw.pcie_bandwidth if self.source == "host" else self.disk_bandwidth

    def load_seconds(self, model: ModelProfile, hw: HardwareProfile) -> float:
        """Seconds to make ``model`` runnable on an instance that does not hold its weights
        (every GPU of a tensor-parallel instance loads its shard at once)."""
        per_gpu = model.weight_bytes / max(model.tensor_parallel, 1)
        fixed = self.optimised_overhead_s if self.optimised else self.reinit_overhead_s
        return per_gpu / self.bandwidth(hw) + fixed
