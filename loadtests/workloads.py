"""Workloads: what to send and when.

* ``synthetic``: gamma-distributed gaps (shape = burstiness; 1 is Poisson) at a mean rate, input
  and output lengths from distributions (``fixed:N``, ``uniform:A:B``, ``normal:MEAN:STD``, or
  ``trace:FILE`` to sample an Azure trace's columns).
* ``trace``: an Azure LLM 2023 CSV (timestamps and lengths) or a Mooncake JSONL (timestamps in
  ms, lengths, ``hash_ids`` of 512-token prefix blocks, replayed with block-identical prompts).
* ``sessions``: multi-turn agent conversations (see ``SessionSpec``), driven turn by turn by
  the runner since each turn carries the previous answer.

Every request forces its output length with ``max_tokens`` + ``ignore_eos``. Prompts are built
before the run starts so the event loop only sends during it.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from backend.textgen import LengthDistribution
from loadtests.prompts import PromptMaker
from loadtests.traces import jsonl_rows, load_azure

Endpoint = Literal["chat", "completions"]


@dataclass(slots=True)
class Planned:
    """One request of an open-loop schedule."""

    t: float
    input_tokens: int
    output_tokens: int
    prompt: str = ""
    meta: dict[str, Any] = field(default_factory=dict)


def parse_lengths(spec: str, column: Literal["input", "output"]) -> LengthDistribution:
    """A length spec of the backend's forms, or ``trace:FILE`` to sample an Azure column."""
    kind, _, rest = spec.partition(":")
    if kind != "trace":
        return LengthDistribution.parse(spec)
    rows = load_azure(rest)
    if not rows:
        raise ValueError(f"bad length spec {spec!r}: the trace has no rows")
    return LengthDistribution.of_samples(
        [r.input_tokens if column == "input" else r.output_tokens for r in rows])


def gamma_arrivals(n: int, rate: float, burstiness: float, rng: random.Random) -> list[float]:
    """Arrival offsets with gamma gaps: mean 1/rate, coefficient of variation 1/sqrt(shape)."""
    if rate <= 0 or burstiness <= 0:
        raise ValueError("rate and burstiness must be positive")
    gen = np.random.default_rng(rng.randrange(2**32))
    gaps = gen.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)
    return [float(x) for x in np.cumsum(gaps)]


def synthetic(n: int, rate: float, burstiness: float, inputs: LengthDistribution,
              outputs: LengthDistribution, maker: PromptMaker, seed: int) -> list[Planned]:
    rng = random.Random(seed)
    times = gamma_arrivals(n, rate, burstiness, rng)
    plan = []
    for t in times:
        i, o = inputs.sample(rng), outputs.sample(rng)
        plan.append(Planned(t, i, o, maker.random_text(i, rng)))
    return plan


def load_mooncake(path: str | Path, limit: int | None = None) -> list[dict[str, Any]]:
    rows = []
    for line_no, row in jsonl_rows(path):
        ok = isinstance(row, dict) and all(
            k in row for k in ("timestamp", "input_length", "output_length", "hash_ids"))
        if not ok:
            raise ValueError(f"{path}:{line_no}: not a Mooncake trace row")
        rows.append(row)
        if limit is not None and len(rows) >= limit:
            break
    return rows


def trace(path: str | Path, maker: PromptMaker, *, limit: int | None, time_scale: float,
          seed: int, max_input: int | None = None) -> list[Planned]:
    """Replay a trace file (format chosen by extension: .jsonl Mooncake, else Azure CSV)."""
    p = Path(path)
    plan: list[Planned] = []
    if p.suffix == ".jsonl":
        for row in load_mooncake(p, limit):
            n_in = int(row["input_length"])
            if max_input is not None and n_in > max_input:
                n_in = max_input
            plan.append(Planned(float(row["timestamp"]) / 1000.0 * time_scale, n_in,
                                int(row["output_length"]) or 1,
                                maker.mooncake(row["hash_ids"], n_in),
                                {"hash_ids": len(row["hash_ids"])}))
        return plan
    rng = random.Random(seed)
    for r in load_azure(p, limit=limit):
        n_in = min(r.input_tokens, max_input) if max_input else r.input_tokens
        plan.append(Planned(r.t * time_scale, n_in, r.output_tokens, maker.random_text(n_in, rng)))
    return plan


@dataclass(frozen=True, slots=True)
class SessionSpec:
    """Agent conversations: each session belongs to one of ``agent_types`` sharing a system
    prompt of ``system_tokens``; turn 1 states a task of ``task_tokens``; every later turn
    appends the previous answer and a tool result of ``tool_tokens``, so the context grows by
    about ``tool_tokens + output`` per turn. Sessions start open-loop (gamma arrivals at
    ``rate`` sessions/s); within a session a turn is sent ``think_time_s`` (exponential mean)
    after the previous answer."""

    sessions: int = 10
    turns: int = 10
    agent_types: int = 3
    system_tokens: int = 2000
    task_tokens: int = 200
    tool_tokens: int = 1000
    output: LengthDistribution = field(default_factory=lambda: LengthDistribution("fixed", 50))
    think_time_s: float = 1.0


@dataclass(slots=True)
class Session:
    """The conversation state of one session, rendered as chat messages."""

    index: int
    start: float
    system: str
    task: str
    tool_results: list[str]
    outputs: list[int]
    think_time_s: float = 0.0
    messages: list[dict[str, str]] = field(default_factory=list)

    def next_messages(self, turn: int, last_answer: str | None) -> list[dict[str, str]]:
        if turn == 0:
            self.messages = [{"role": "system", "content": self.system},
                             {"role": "user", "content": self.task}]
        else:
            self.messages.append({"role": "assistant", "content": last_answer or ""})
            self.messages.append({"role": "user", "content": self.tool_results[turn - 1]})
        return self.messages


def sessions(spec: SessionSpec, rate: float, burstiness: float, maker: PromptMaker,
             seed: int) -> list[Session]:
    rng = random.Random(seed)
    starts = gamma_arrivals(spec.sessions, rate, burstiness, rng)
    systems = [maker.random_text(spec.system_tokens, rng) for _ in range(spec.agent_types)]
    out = []
    for i, t in enumerate(starts):
        out.append(Session(
            i, t, systems[i % spec.agent_types], maker.random_text(spec.task_tokens, rng),
            [maker.random_text(spec.tool_tokens, rng) for _ in range(spec.turns - 1)],
            [spec.output.sample(rng) for _ in range(spec.turns)], spec.think_time_s))
    return out


def request_body(model: str, endpoint: Endpoint, prompt: str | Sequence[dict[str, str]],
                 max_tokens: int) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "ignore_eos": True,
                            "stream": True, "stream_options": {"include_usage": True}}
    if endpoint == "chat":
        body["messages"] = ([{"role": "user", "content": prompt}] if isinstance(prompt, str)
                            else list(prompt))
    else:
        body["prompt"] = prompt
    return body
