"""Where a many-model request's time goes, cause by cause (``simulator.multimodel``).

Every engine step of an instance is charged to each of its requests that is waiting then:

* before its first token (TTFT): to ``switch`` for the weight loading the step began with;
  for the step's compute, to ``other_prefill`` or ``other_decode`` when another model ran
  (a step with prompt tokens in it, or decode only), to ``own_prefill`` when the step
  computed part of its own prompt, else to ``own_queue`` (its model ran without it: behind
  that model's other requests);
* while it decodes (TPOT): to ``decode_switch`` and ``decode_other`` when the step was
  another model's (the gaps between its tokens that sharing the GPU adds), else
  ``decode_own``.

The path before the engine (``FleetConfig.path_in_s``) is ``path``; in a disaggregated fleet,
the KV's crossing from the prefill instance to the decode instance is ``transfer``. A request's
TTFT causes sum to its TTFT less the time its first token took to reach the client
(``path_out_s``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

TTFT_CAUSES = ("path", "switch", "other_prefill", "other_decode", "own_queue", "own_prefill",
               "transfer")
TPOT_CAUSES = ("decode_switch", "decode_other", "decode_own")


def charge(lost: dict[str, float], cause: str, seconds: float) -> None:
    if seconds > 0:
        lost[cause] = lost.get(cause, 0.0) + seconds


def step(waiting: Iterable[tuple[Any, bool, bool]], switch_s: float, compute_s: float,
         with_prompt: bool) -> None:
    """Charge one step to each ``(request, of the step's model, scheduled in it)``'s causes
    (``request.lost``): ``switch_s`` of weight loading, then ``compute_s``;
    ``with_prompt``: the step computed prompt tokens."""
    for mr, same, scheduled in waiting:
        lost = mr.lost
        if mr.first_token is None:
            charge(lost, "switch", switch_s)
            if not same:
                charge(lost, "other_prefill" if with_prompt else "other_decode", compute_s)
            else:
                charge(lost, "own_prefill" if scheduled else "own_queue", compute_s)
        else:
            charge(lost, "decode_switch", switch_s)
            charge(lost, "decode_own" if same else "decode_other", compute_s)


def summary(reqs: Sequence[Any], ttft_s: float, tpot_s: float) -> dict[str, Any]:
    """Mean ms per request of each cause: over every request and over those that missed
    the SLO (``missed``); TPOT causes per output token after the first."""
    def means(rs: Sequence[Any]) -> dict[str, float]:
        out: dict[str, float] = {}
        if not rs:
            return out
        for c in TTFT_CAUSES:
            out[c] = float(np.mean([r.lost.get(c, 0.0) for r in rs])) * 1e3
        gaps = [max(r.tokens - 1, 1) for r in rs]
        for c in TPOT_CAUSES:
            out[c + "_per_token"] = float(np.mean(
                [r.lost.get(c, 0.0) / g for r, g in zip(rs, gaps, strict=True)])) * 1e3
        return out

    missed = [r for r in reqs if not r.meets(ttft_s, tpot_s)]
    return {"all": means(reqs), "missed": means(missed), "missed_requests": len(missed)}
