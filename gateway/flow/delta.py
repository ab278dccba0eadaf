"""What a replica did to one shared fair-share counter since its last exchange
(``gateway.flow.share``), composed exactly: charges and lifts, so that a lift is never *added*
to what the other replicas counted."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(slots=True)
class Delta:
    """What a replica did to one shared counter since its last exchange, composed exactly:
    the counter ``x`` becomes ``max(x + before, lift) + after`` (``lift`` -inf: none)."""

    before: float = 0.0
    lift: float = -math.inf
    after: float = 0.0

    def add(self, amount: float) -> None:
        self.after += amount

    def lift_to(self, floor: float) -> None:
        # max(max(x + b, f) + a, g) = max(x + b + a, f + a, g)
        self.before += self.after
        self.lift = max(self.lift + self.after, floor)
        self.after = 0.0

    def then(self, newer: Delta) -> Delta:
        """This change followed by ``newer``."""
        return Delta(self.before + self.after + newer.before,
                     max(self.lift + self.after + newer.before, newer.lift), newer.after)

    def apply(self, x: float) -> float:
        return max(x + self.before, self.lift) + self.after
