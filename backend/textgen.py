"""Seeded output: when a request stops (its length distribution) and which words it says.

``LengthDistribution.parse`` reads specs such as ``fixed:128``, ``uniform:16:512``,
``normal:200:50``, ``exponential:200`` or ``lognormal:256:0.8`` (mean, sigma of the underlying
normal). A request
without ``ignore_eos`` stops at a length drawn from it (capped by ``max_tokens``, at least
``min_tokens``); with ``ignore_eos`` it runs to ``max_tokens``. Every draw comes from the
request's own ``random.Random`` seeded by its ``seed`` (or the engine's seed and a counter), so
the same request gives the same text.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar


@dataclass(frozen=True, slots=True)
class LengthDistribution:
    """A token-length distribution; ``samples`` draws from observed lengths (e.g. a trace)."""

    kind: str
    a: float = 0.0
    b: float = 0.0
    samples: tuple[int, ...] = ()

    _ARITY: ClassVar[dict[str, int]] = {"fixed": 1, "uniform": 2, "normal": 2,
                                        "exponential": 1, "lognormal": 2}

    @classmethod
    def parse(cls, spec: str) -> LengthDistribution:
        kind, _, rest = spec.partition(":")
        try:
            nums = [float(x) for x in rest.split(":")] if rest else []
        except ValueError:
            raise ValueError(f"bad length spec {spec!r}: arguments must be numbers") from None
        if kind not in cls._ARITY or len(nums) != cls._ARITY[kind]:
            raise ValueError(f"bad length spec {spec!r}: use fixed:N, uniform:A:B, "
                             "normal:MEAN:STD, exponential:MEAN or lognormal:MEAN:SIGMA")
        if nums[0] <= 0 or (kind == "uniform" and nums[1] < nums[0]):
            raise ValueError(f"bad length spec {spec!r}: lengths must be positive")
        return cls(kind, nums[0], nums[1] if len(nums) > 1 else 0.0)

    @classmethod
    def of_samples(cls, values: Sequence[int]) -> LengthDistribution:
        if not values:
            raise ValueError("a sampled length distribution needs at least one value")
        return cls("samples", samples=tuple(values))

    def sample(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            x: float = self.a
        elif self.kind == "uniform":
            x = rng.uniform(self.a, self.b)
        elif self.kind == "normal":
            x = rng.gauss(self.a, self.b)
        elif self.kind == "exponential":
            x = rng.expovariate(1.0 / self.a)
        elif self.kind == "lognormal":  # the mean is ``a``; ``b`` is the underlying sigma
            x = rng.lognormvariate(math.log(self.a) - self.b * self.b / 2.0, self.b)
        else:
            x = self.samples[rng.randrange(len(self.samples))]
        return max(1, round(x))


class WordSource:
    """The seeded stream of output word ids of one request."""

    __slots__ = ("_rng", "_words")

    def __init__(self, words: list[int], rng: random.Random) -> None:
        self._words = words
        self._rng = rng

    def next(self) -> int:
        return self._words[self._rng.randrange(len(self._words))]
