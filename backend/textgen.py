"""Seeded output: when a request stops (its length distribution) and which words it says.

``LengthDistribution.parse`` reads specs such as ``fixed:128``, ``uniform:16:512``,
``exponential:200`` or ``lognormal:256:0.8`` (mean, sigma of the underlying normal). A request
without ``ignore_eos`` stops at a length drawn from it (capped by ``max_tokens``, at least
``min_tokens``); with ``ignore_eos`` it runs to ``max_tokens``. Every draw comes from the
request's own ``random.Random`` seeded by its ``seed`` (or the engine's seed and a counter), so
the same request gives the same text.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LengthDistribution:
    kind: str
    a: float
    b: float = 0.0

    @classmethod
    def parse(cls, spec: str) -> LengthDistribution:
        parts = spec.split(":")
        kind, args = parts[0], parts[1:]
        try:
            nums = [float(x) for x in args]
        except ValueError:
            raise ValueError(f"bad output length spec {spec!r}: arguments must be numbers"
                             ) from None
        arity = {"fixed": 1, "uniform": 2, "exponential": 1, "lognormal": 2}
        if kind not in arity:
            raise ValueError(f"bad output length spec {spec!r}: kind must be one of "
                             f"{sorted(arity)}")
        if len(nums) != arity[kind]:
            raise ValueError(f"bad output length spec {spec!r}: {kind} takes "
                             f"{arity[kind]} numbers")
        if nums[0] <= 0 or (kind == "uniform" and nums[1] < nums[0]):
            raise ValueError(f"bad output length spec {spec!r}: lengths must be positive")
        return cls(kind, nums[0], nums[1] if len(nums) > 1 else 0.0)

    def sample(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            x = self.a
        elif self.kind == "uniform":
            x = rng.uniform(self.a, self.b)
        elif self.kind == "exponential":
            x = rng.expovariate(1.0 / self.a)
        else:  # lognormal with the given mean
            sigma = self.b
            x = rng.lognormvariate(math.log(self.a) - sigma * sigma / 2.0, sigma)
        return max(1, round(x))


class WordSource:
    """The seeded stream of output word ids of one request."""

    __slots__ = ("_rng", "_words")

    def __init__(self, words: list[int], rng: random.Random) -> None:
        self._words = words
        self._rng = rng

    def next(self) -> int:
        return self._words[self._rng.randrange(len(self._words))]
