"""The learned models' one version: each target's compiled trees shrunk towards a constant
(``Learned``), the pair and its XGBoost JSON (``Models``), saved and shared as one document.
What ``predictor.online`` trains and swaps in, and ``predictor.sync`` shares across replicas."""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from predictor.features import FEATURES
from predictor.trees import CompiledTrees

TARGETS = ("ttft", "tpot")


@dataclass(frozen=True, slots=True)
class Learned:
    """One target's model, in log milliseconds: the trees' margin shrunk towards a constant,
    ``weight × trees + (1 − weight) × center``."""

    trees: CompiledTrees
    weight: float = 1.0
    center: float = 0.0

    def predict(self, x: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
        m = self.trees.predict(x)
        if self.weight == 1.0:
            return m
        out: npt.NDArray[np.float64] = self.weight * m + (1.0 - self.weight) * self.center
        return out


@dataclass(frozen=True, slots=True)
class Models:
    """One version of the learned models; a target without enough samples yet has none and
    keeps the analytic estimate."""

    version: int
    ttft: Learned | None
    tpot: Learned | None
    raw: dict[str, str]  # target -> XGBoost model JSON
    samples: int
    shrink: dict[str, tuple[float, float]]  # target -> (weight, center)

    @classmethod
    def from_raw(cls, version: int, raw: dict[str, str], samples: int = 0,
                 shrink: dict[str, tuple[float, float]] | None = None) -> Models:
        shrink = shrink or {}

        def learned(t: str) -> Learned | None:
            if t not in raw:
                return None
            w, c = shrink.get(t, (1.0, 0.0))
            return Learned(CompiledTrees(raw[t]), w, c)

        return cls(version, learned("ttft"), learned("tpot"), raw, samples, shrink)

    def to_json(self) -> bytes:
        return json.dumps({"version": self.version, "features": list(FEATURES),
                           "samples": self.samples, "models": self.raw,
                           "shrink": {t: list(v) for t, v in self.shrink.items()}}).encode()

    @classmethod
    def from_json(cls, data: bytes | str) -> Models:
        doc = json.loads(data)
        if list(doc.get("features", [])) != list(FEATURES):
            raise ValueError("the saved model was trained on a different feature list")
        shrink = {t: (float(v[0]), float(v[1])) for t, v in doc.get("shrink", {}).items()}
        return cls.from_raw(int(doc["version"]), doc["models"], int(doc.get("samples", 0)),
                            shrink)
