"""Many-model workloads: a generated long tail, or a JSONL trace that names a model per row.

**Long tail** (``longtail``): ``models`` models whose popularity follows Zipf's law (model i gets
a share ∝ 1/(i+1)^s of ``rate``), each with bursty arrivals built from an Azure LLM trace: a
model's stream is a window of the trace, starting at a seeded offset, stretched in time so its
mean rate is the model's share. A popular model sees the trace at about its own pace; a cold
one sees a second of the trace spread over minutes: a few requests close together, then quiet,
which is how long-tail models are asked (Aegaeon measured 94 % of models taking 1.35 % of the
requests on a model market). Prompt and output lengths are the trace rows' own.

**Trace** (``from_jsonl``): rows ``{"t": seconds, "model": NAME, "input_tokens": N,
"output_tokens": M}`` (``timestamp`` is read as ``t``; rows without ``model`` get ``default``).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path

from loadtests.traces import TRACES, jsonl_rows, load_azure

AZURE_CONV = TRACES / "azure_llm_2023_conv.csv"


@dataclass(slots=True, eq=False)
class ModelRequest:
    """A request of a many-model workload and what happened to it (virtual seconds)."""

    rid: int
    model: str
    t: float
    prompt_tokens: int
    output_tokens: int
    instance: str = ""
    first_token: float | None = None
    done: float | None = None
    tokens: int = 0
    times: list[float] = field(default_factory=list)
    lost: dict[str, float] = field(default_factory=dict)  # seconds by cause (simulator.causes)
    prefilled: float | None = None  # a disaggregated fleet: when its prompt left prefill

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.t

    @property
    def tpot(self) -> float | None:
        if self.first_token is None or self.done is None or self.tokens < 2:
            return None
        return (self.done - self.first_token) / (self.tokens - 1)

    def meets(self, ttft_s: float, tpot_s: float) -> bool:
        ttft, tpot = self.ttft, self.tpot
        return ttft is not None and self.done is not None and ttft <= ttft_s \
            and (tpot is None or tpot <= tpot_s)


def zipf_shares(models: int, s: float = 1.0) -> list[float]:
    weights = [1.0 / (i + 1) ** s for i in range(models)]
    total = sum(weights)
    return [w / total for w in weights]


def model_names(models: int) -> list[str]:
    width = len(str(models - 1))
    return [f"m{i:0{width}d}" for i in range(models)]


def longtail(models: int, rate: float, duration_s: float, *, zipf_s: float = 1.0,
             seed: int = 0, trace: Path = AZURE_CONV, max_input: int = 8192,
             max_output: int = 1024) -> list[ModelRequest]:
    """``duration_s`` seconds of a ``models``-model long tail at ``rate`` requests/s in all."""
    if models <= 0 or rate <= 0 or duration_s <= 0:
        raise ValueError("a long tail needs models, a rate and a duration, all positive")
    rows = load_azure(trace)
    span = rows[-1].t - rows[0].t
    trace_rate = len(rows) / span
    rng = random.Random(seed)
    out: list[ModelRequest] = []
    for name, share in zip(model_names(models), zipf_shares(models, zipf_s), strict=True):
        stretch = trace_rate / (rate * share)  # virtual seconds per trace second
        # the window opens at a random instant, not at a request: a model's first arrival
        # comes after a share of the trace's gap, not with every other model's at 0
        start = rows[0].t + rng.uniform(0.0, span)
        i = next((k for k, r in enumerate(rows) if r.t >= start), len(rows))
        base, wraps = start, 0.0
        if i == len(rows):
            i, wraps = 0, span
        while True:
            r = rows[i]
            t = (r.t + wraps - base) * stretch
            if t >= duration_s:
                break
            out.append(ModelRequest(0, name, t, min(r.input_tokens, max_input),
                                    min(r.output_tokens, max_output)))
            i += 1
            if i == len(rows):
                i, wraps = 0, wraps + span
    out.sort(key=lambda x: (x.t, x.model))
    for k, x in enumerate(out):
        x.rid = k
    return out


def zipf_models(requests: list[ModelRequest], models: int, zipf_s: float, seed: int = 0
                ) -> list[ModelRequest]:
    """``requests`` (one model's trace) spread over ``models`` models with Zipf(``zipf_s``)
    popularity, each request drawn independently (seeded): the same arrivals and lengths,
    many models."""
    rng = random.Random(seed)
    names = model_names(models)
    weights = zipf_shares(models, zipf_s)
    for r, m in zip(requests, rng.choices(names, weights, k=len(requests)), strict=True):
        r.model = m
    return requests


def from_trace(path: str | Path, default: str) -> list[ModelRequest]:
    """A trace naming a model per row: an Azure LLM CSV (with a ``model`` column) or a JSONL
    (``from_jsonl``), by extension."""
    if Path(path).suffix.lower() != ".csv":
        return from_jsonl(path, default)
    out = [ModelRequest(k, r.model or default, r.t, r.input_tokens, r.output_tokens)
           for k, r in enumerate(load_azure(path))]
    if not out:
        raise ValueError(f"{path}: no rows")
    return out


def from_jsonl(path: str | Path, default: str) -> list[ModelRequest]:
    """A trace naming a model per row (``default`` where a row names none), in either form:
    ``t`` (seconds), ``input_tokens``, ``output_tokens``; or Mooncake's, ``timestamp`` (ms),
    ``input_length``, ``output_length`` (its other fields, such as ``hash_ids``, ignored)."""
    out: list[ModelRequest] = []
    for line_no, row in jsonl_rows(path):
        try:
            if "input_length" in row:  # Mooncake
                t = float(row["timestamp"]) / 1000.0
                n_in = int(row["input_length"])
                n_out = int(row["output_length"])
            else:
                t = float(row.get("t", row.get("timestamp", 0.0)))
                n_in = int(row["input_tokens"])
                n_out = int(row["output_tokens"])
            model = str(row.get("model") or default)
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"{path}:{line_no}: expected t, input_tokens, output_tokens (or "
                             f"Mooncake's timestamp in ms, input_length, output_length) and "
                             f"optionally model ({exc})") from None
        if n_in <= 0 or n_out <= 0:
            raise ValueError(f"{path}:{line_no}: token counts must be positive")
        out.append(ModelRequest(0, model, t, n_in, n_out))
    if not out:
        raise ValueError(f"{path}: no rows")
    out.sort(key=lambda r: r.t)
    t0 = out[0].t
    for k, r in enumerate(out):
        r.rid, r.t = k, r.t - t0
    return out
