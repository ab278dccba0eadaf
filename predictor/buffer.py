"""A bounded training-sample buffer, stratified by load and prefix-hit buckets.

Under steady traffic most samples look alike (the common load level, the common hit rate); a
plain ring buffer would forget the rare regimes (a burst, a cold cache) the router most needs
to predict. Each stratum keeps its own most recent ``per_bucket`` samples, so a regime seen
once stays represented until it is seen again.
"""

from __future__ import annotations

import math
from collections import deque

import numpy as np
import numpy.typing as npt

from predictor.features import F


def stratum(row: npt.NDArray[np.float64]) -> tuple[int, int]:
    """(load bucket: log2 of in-flight + waiting, prefix-hit bucket: cached share in quarters)."""
    load = row[F["in_flight"]] + row[F["waiting"]]
    load_bucket = min(int(math.log2(load + 1.0)), 8)
    prompt = row[F["prompt_tokens"]]
    hit = 1.0 - row[F["uncached_tokens"]] / prompt if prompt > 0 else 0.0
    return load_bucket, min(int(max(hit, 0.0) * 4), 3)


class SampleBuffer:
    def __init__(self, per_bucket: int = 512) -> None:
        self.per_bucket = per_bucket
        self._buckets: dict[tuple[int, int], deque[tuple[npt.NDArray[np.float64], float]]] = {}
        self.added = 0

    def add(self, row: npt.NDArray[np.float64], target: float) -> None:
        key = stratum(row)
        b = self._buckets.get(key)
        if b is None:
            b = self._buckets[key] = deque(maxlen=self.per_bucket)
        b.append((row, target))
        self.added += 1

    def __len__(self) -> int:
        return sum(len(b) for b in self._buckets.values())

    def strata(self) -> dict[tuple[int, int], int]:
        return {k: len(b) for k, b in self._buckets.items()}

    def arrays(self, exclude: set[int] | frozenset[int] = frozenset()
               ) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]]:
        """A copy of every sample as (X, y), safe to train on in another thread; rows whose
        ``id`` is in ``exclude`` (held out for validation) are left out."""
        items = [s for b in list(self._buckets.values()) for s in list(b)
                 if id(s[0]) not in exclude]
        if not items:
            return np.empty((0, len(F))), np.empty(0)
        return np.vstack([r for r, _ in items]), np.asarray([t for _, t in items])
