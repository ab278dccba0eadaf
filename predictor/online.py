"""Online TTFT/TPOT prediction: samples in, XGBoost models trained in the background, out.

* ``predict(x)`` answers for every candidate of a decision in one call: the prior (the
  roofline of ``predictor.prior`` the router put in the row, or the analytic estimate) times
  the factor the compiled trees of the current models (``trees.CompiledTrees``) learned.
  Models are fitted on log(actual / prior), so squared error there is relative error here,
  and a fresh gateway (no model yet) predicts the prior itself.
* ``observe(...)`` records what a request actually saw against the features it was routed on,
  adds the sample to a stratified buffer, and keeps the rolling absolute percentage error of
  the prediction that was used: live accuracy, measured rather than assumed.
* ``run()`` retrains every ``retrain_s`` once ``min_samples`` are in and the new ones are at
  least ``min_new_fraction`` of those buffered, in a worker thread (XGBoost releases the GIL
  while it fits), then swaps the new pair in with one assignment: a decision sees the old
  models or the new ones, never a mix.
* Each fit is validated before it is used: the most recent ``holdout`` observations of the
  target are left out of its training set, and the model's log prediction is shrunk towards
  the training median by the weight (1, 0.75, 0.5, 0.25 or 0) that predicts those held-out
  requests best. Where the features explain the target the weight stays 1; where they do not
  (TPOT on an aggregated endpoint, set by prefill work that arrives after the decision, see
  ``benchmarks.predictability``) a tree fitted to noise would do worse than the median, and
  the shrinkage stops it.
* ``save``/``load`` write and read both models (``predictor.models``) as XGBoost JSON;
  ``predictor.sync`` shares them across gateway replicas through Redis.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from predictor import analytic
from predictor.buffer import SampleBuffer
from predictor.features import FEATURES
from predictor.models import TARGETS, Models
from predictor.trees import CompiledTrees

log = logging.getLogger("tokengate.predictor")
SHRINK_WEIGHTS = (1.0, 0.75, 0.5, 0.25, 0.0)


@dataclass(slots=True)
class TrainConfig:
    min_samples: int = 200
    retrain_s: float = 5.0
    # Smooth trees: TTFT and TPOT carry noise no decision-time feature explains (prompts that
    # arrive later share a request's chunked-prefill steps). Replaying four dumped runs'
    # observations offline, depth 5 / eta 0.1 / 120 rounds / min_child_weight 5 cut the TTFT
    # error by 3 % of itself against the earlier depth 6 / eta 0.15 / 80 / 2.
    rounds: int = 120
    max_depth: int = 5
    eta: float = 0.1
    min_child_weight: float = 5.0
    # Histogram bins per feature: 64 fits in half the time of XGBoost's 256 (0.19 s against
    # 0.41 s for 4,000 rows here) with the same error (the simulator's matrix workloads).
    max_bin: int = 64
    per_bucket: int = 512
    window: int = 500  # observations in the rolling error
    holdout: int = 100  # most recent observations a fit is validated on (not trained on)
    min_holdout: int = 30  # fewer: no validation, the fit is used as it is
    # Refit once the new observations are this share of those buffered (and at least one):
    # a fit costs ~0.2 s of CPU, and 25 new samples among 2,000 barely move the trees.
    min_new_fraction: float = 0.1


@dataclass(slots=True)
class TrainingSet:
    """A fit's inputs, per target: (features, log targets, held-out observations)."""

    added: int
    parts: dict[str, tuple[npt.NDArray[np.float64], npt.NDArray[np.float64],
                           list[tuple[npt.NDArray[np.float64], float]]]]


class OnlinePredictor:
    def __init__(self, config: TrainConfig | None = None,
                 on_error: Callable[[str, float], None] | None = None) -> None:
        self.config = config or TrainConfig()
        self.buffers = {t: SampleBuffer(self.config.per_bucket) for t in TARGETS}
        self.recent: dict[str, deque[tuple[npt.NDArray[np.float64], float]]] = {
            t: deque(maxlen=self.config.holdout) for t in TARGETS}
        self.validation: dict[str, dict[str, float]] = {}
        self.models: Models | None = None
        self.errors: dict[str, deque[float]] = {
            t: deque(maxlen=self.config.window) for t in TARGETS}
        self._on_error = on_error
        self._trained_at_count = 0
        self._errors_seen = {t: 0 for t in TARGETS}  # errors ever appended, per target
        self._p90: tuple[int, float] = (-1, 1.25)  # (errors seen, factor) last computed
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="predictor-train")
        self.trainings = 0
        self.last_train_s = 0.0
        # TOKENGATE_PREDICTOR_DUMP=FILE appends every observation as a JSON line (send time,
        # features, actual and predicted): offline analysis and training from real traffic.
        dump = os.environ.get("TOKENGATE_PREDICTOR_DUMP")
        self._dump = open(dump, "a") if dump else None  # noqa: SIM115 - lives with the predictor

    # -- inference --------------------------------------------------------------------------

    def predict(self, x: npt.NDArray[np.float64]
                ) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]]:
        """Predicted (TTFT ms, TPOT ms) for each row of ``x``."""
        m = self.models  # one read: a concurrent swap cannot mix two versions
        ttft, tpot = _prior("ttft", x), _prior("tpot", x)
        if m is None:
            return ttft, tpot
        if m.ttft:
            ttft = ttft * np.exp(m.ttft.predict(x))
        if m.tpot:
            tpot = tpot * np.exp(m.tpot.predict(x))
        return ttft, tpot

    def tpot_p90_factor(self) -> float:
        """How much above its point estimate a request's TPOT stays 90 % of the time: the
        90th percentile of actual / predicted over the recent requests (1.25 before 30)."""
        seen, factor = self._p90
        if seen == self._errors_seen["tpot"]:
            return factor  # every decision asks; it changes only when a request ends
        errs = self.errors["tpot"]
        factor = 1.25
        if len(errs) >= 30:
            ratios = 1.0 / (1.0 + np.asarray(errs))  # err = predicted / actual - 1
            factor = float(max(np.percentile(ratios, 90), 1.0))
        self._p90 = (self._errors_seen["tpot"], factor)
        return factor

    @property
    def source(self) -> str:
        m = self.models
        if m is None:
            return "analytic"
        return f"xgboost-v{m.version}" + ("" if m.ttft and m.tpot else "-partial")

    # -- observations -----------------------------------------------------------------------

    def observe(self, row: npt.NDArray[np.float64], *, ttft_ms: float | None,
                tpot_ms: float | None, predicted_ttft_ms: float | None = None,
                predicted_tpot_ms: float | None = None, sent_at: float | None = None) -> None:
        """Record what a request saw against its routing row (``sent_at``: when it was sent,
        ``time.perf_counter``, only for the dump)."""
        if self._dump is not None:
            self._dump.write(json.dumps({"sent": sent_at, "x": row.tolist(),
                                         "ttft": ttft_ms, "tpot": tpot_ms,
                                         "pred_ttft": predicted_ttft_ms,
                                         "pred_tpot": predicted_tpot_ms,
                                         "source": self.source}) + "\n")
        for target, actual, predicted in (("ttft", ttft_ms, predicted_ttft_ms),
                                          ("tpot", tpot_ms, predicted_tpot_ms)):
            if actual is None or not math.isfinite(actual) or actual <= 0:
                continue
            self._add(target, row, math.log(actual))
            if predicted is not None:
                err = (predicted - actual) / actual
                self.errors[target].append(err)
                self._errors_seen[target] += 1
                if self._on_error is not None:
                    self._on_error(target, abs(err))

    def mape(self, target: str) -> float | None:
        errs = self.errors[target]
        return float(np.mean(np.abs(errs))) if errs else None

    def error_summary(self, target: str) -> dict[str, float]:
        """Signed relative errors (predicted − actual) / actual: quantiles and MAPE."""
        errs = np.asarray(self.errors[target])
        if errs.size == 0:
            return {}
        q = np.percentile(errs, [1, 10, 50, 90, 99])
        return {"n": float(errs.size), "mape": float(np.mean(np.abs(errs))),
                "p01": float(q[0]), "p10": float(q[1]), "p50": float(q[2]), "p90": float(q[3]),
                "p99": float(q[4]), "within_10pct": float(np.mean(np.abs(errs) <= 0.10))}

    def add_samples(self, target: str, rows: npt.NDArray[np.float64],
                    log_targets: npt.NDArray[np.float64]) -> None:
        """Samples observed elsewhere (another replica), already as log milliseconds."""
        for r, y in zip(rows, log_targets, strict=True):
            self._add(target, r, float(y))

    def _add(self, target: str, row: npt.NDArray[np.float64], log_ms: float) -> None:
        self.buffers[target].add(row, log_ms)
        self.recent[target].append((row, log_ms))

    # -- training ---------------------------------------------------------------------------

    def ready_to_train(self) -> bool:
        n = max(len(b) for b in self.buffers.values())
        added = sum(b.added for b in self.buffers.values())
        held = sum(len(b) for b in self.buffers.values())
        new = added - self._trained_at_count
        return n >= self.config.min_samples and new >= max(1.0, self.config.min_new_fraction
                                                           * held)

    def train_now(self) -> Models | None:
        """Fit a model for every target with enough samples and swap the set in (call from a
        thread)."""
        fitted = self.fit()
        if fitted is not None:
            self.install(*fitted)
        return fitted[0] if fitted is not None else None

    def install(self, models: Models, added: int) -> None:
        """Swap in models ``fit`` returned (``added``: the sample count they were fitted at).
        The simulator calls it when the modelled training time has passed."""
        self.models = models
        self._trained_at_count = added
        self.trainings += 1

    def fit(self) -> tuple[Models, int] | None:
        """Fit a model for every target with enough samples; nothing is swapped in."""
        return self.fit_snapshot(self.snapshot())

    def snapshot(self) -> TrainingSet:
        """What a fit would train and validate on, copied: ``fit_snapshot`` may then run in
        another thread while observations keep arriving."""
        parts = {}
        for target in TARGETS:
            # Hold out only what the training set can spare: the first fit comes as soon
            # as ``min_samples`` are in, validated from the next one on.
            spare = len(self.buffers[target]) - self.config.min_samples
            held = list(self.recent[target])[-spare:] if spare > 0 else []
            if len(held) < self.config.min_holdout:
                held = []
            x, y = self.buffers[target].arrays(exclude={id(r) for r, _ in held})
            parts[target] = (x, y, held)
        return TrainingSet(sum(b.added for b in self.buffers.values()), parts)

    def fit_snapshot(self, ts: TrainingSet) -> tuple[Models, int] | None:
        import xgboost as xgb

        raw: dict[str, str] = {}
        shrink: dict[str, tuple[float, float]] = {}
        n = 0
        for target, (x, y_abs, held) in ts.parts.items():
            if len(y_abs) < self.config.min_samples:
                continue
            y = y_abs - np.log(_prior(target, x))  # the trees learn log(actual / prior)
            n += len(y)
            booster = xgb.train(
                {"max_depth": self.config.max_depth, "eta": self.config.eta, "nthread": 1,
                 "objective": "reg:squarederror",
                 "min_child_weight": self.config.min_child_weight, "subsample": 0.9,
                 "max_bin": self.config.max_bin,
                 "seed": 0, "verbosity": 0},
                xgb.DMatrix(x, label=y, feature_names=list(FEATURES)), self.config.rounds)
            raw[target] = bytes(booster.save_raw("json")).decode()
            shrink[target] = self._validate(target, CompiledTrees(raw[target]),
                                            float(np.median(y)), held)
        if not raw:
            return None
        version = (self.models.version if self.models else 0) + 1
        return Models.from_raw(version, raw, n, shrink), ts.added

    def _validate(self, target: str, trees: CompiledTrees, center: float,
                  held: list[tuple[npt.NDArray[np.float64], float]]) -> tuple[float, float]:
        """The shrinkage weight that predicts the held-out requests best (ties: the model)."""
        if not held:
            return 1.0, center
        hx = np.vstack([r for r, _ in held])
        actual = np.exp(np.asarray([y for _, y in held]))
        margin = trees.predict(hx)
        prior = _prior(target, hx)
        errors = {w: float(np.mean(np.abs(prior * np.exp(w * margin + (1 - w) * center)
                                          - actual) / actual)) for w in SHRINK_WEIGHTS}
        best = min(SHRINK_WEIGHTS, key=lambda w: errors[w])  # weights in descending order
        self.validation[target] = {"n": float(len(held)), "weight": best,
                                   "mape_model": errors[1.0], "mape_median": errors[0.0],
                                   "mape_used": errors[best]}
        return best, center

    async def train_async(self) -> Models | None:
        loop = asyncio.get_running_loop()
        t = loop.time()
        models = await loop.run_in_executor(self._executor, self.train_now)
        self.last_train_s = loop.time() - t
        return models

    async def run(self, publish: Callable[[Models], Any] | None = None,
                  may_train: Callable[[], bool] = lambda: True) -> None:
        """Retrain in the background forever (cancel to stop)."""
        while True:
            await asyncio.sleep(self.config.retrain_s)
            if not may_train() or not self.ready_to_train():
                continue
            try:
                models = await self.train_async()
            except Exception:  # a failed fit keeps the current models
                log.exception("predictor training failed")
                continue
            if models is not None and publish is not None:
                res = publish(models)
                if asyncio.iscoroutine(res):
                    await res

    # -- persistence --------------------------------------------------------------------------

    def save(self, path: str | Path) -> None:
        if self.models is None:
            raise ValueError("no trained model to save yet")
        Path(path).write_bytes(self.models.to_json())

    def load(self, path: str | Path) -> None:
        self.models = Models.from_json(Path(path).read_bytes())

    def adopt(self, models: Models) -> None:
        """Use models trained elsewhere (they replace ours only if newer)."""
        if self.models is None or models.version > self.models.version:
            self.models = models

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
        if self._dump is not None:
            self._dump.close()


def _prior(target: str, x: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    """The prior the learned factor multiplies (never below 1 µs)."""
    p = analytic.predict_ttft_ms(x) if target == "ttft" else analytic.predict_tpot_ms(x)
    out: npt.NDArray[np.float64] = np.maximum(p, 1e-3)
    return out


def summary(p: OnlinePredictor) -> dict[str, Any]:
    return {"source": p.source, "trainings": p.trainings,
            "last_train_s": round(p.last_train_s, 4),
            "samples": {t: len(b) for t, b in p.buffers.items()},
            "strata": {t: {f"{k[0]}:{k[1]}": v for k, v in b.strata().items()}
                       for t, b in p.buffers.items()},
            "error": {t: p.error_summary(t) for t in TARGETS},
            "validation": p.validation}
