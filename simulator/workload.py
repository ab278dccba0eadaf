"""The load harness's workloads as the simulator's requests: the same schedules, lengths and
prompt contents ``tokengate loadtest`` would send, as token ids and block hashes.

The builders draw from the same generators in the same order as ``loadtests.workloads`` (its
arrival and length functions, ``PromptMaker``'s words and Mooncake blocks), so a seed gives
the same schedule, the same lengths and the same prefix sharing as a real run (a completion
prompt of N words is N tokens, a word's token id is ``maker.words[i]``; synthetic prompts are
token for token the load harness's, since their lengths are drawn between their words). Trace
prompts' words are drawn more cheaply than the harness draws them (numpy): Mooncake blocks of
the same id are identical and blocks of different ids differ, random prompts share nothing,
which is all a cache can tell.
Sessions render each turn with the model's own chat counting (``gateway.counting.tokenize``),
and the answer a turn generates is sent back in the next one.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable, Coroutine, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from gateway.counting.tokenize import TokenCounter
from loadtests import workloads
from loadtests.prompts import MOONCAKE_BLOCK, PromptMaker
from loadtests.traces import load_azure
from simulator.hashing import SegmentHasher, extend
from simulator.requests import SimRequest


@dataclass(slots=True)
class WorkloadSpec:
    kind: str  # "trace" | "synthetic" | "sessions"
    trace: str | None = None
    requests: int | None = None
    duration_s: float | None = None
    time_scale: float = 1.0
    rate: float = 1.0
    burstiness: float = 1.0
    input_len: str = "fixed:512"
    output_len: str = "fixed:128"
    max_input: int | None = None
    sessions: workloads.SessionSpec | None = None
    seed: int = 0


class Builder:
    """Token ids and hashes of prompts, for one block size and hash root."""

    def __init__(self, maker: PromptMaker, block_size: int, root: int) -> None:
        self.maker = maker
        self.block_size = block_size
        self.root = root
        self.words = maker.words
        self._segments = SegmentHasher(block_size, root, MOONCAKE_BLOCK)
        self._blocks: dict[int, list[int]] = {}
        self._words = np.asarray(self.words, dtype=np.int64)

    def ids(self, word_indices: Sequence[int]) -> list[int]:
        w = self.words
        return [w[i] for i in word_indices]

    def random(self, n: int, gen: np.random.Generator) -> list[int]:
        """``n`` random words' token ids (numpy's generator: the load harness draws others,
        and random prompts share no block either way)."""
        out: list[int] = self._words[gen.integers(0, len(self.words), n)].tolist()
        return out

    def request(self, index: int, t: float, ids: Sequence[int], output: int) -> SimRequest:
        hashes = extend([], ids, self.block_size, self.root)
        return SimRequest(index, t, ids, hashes, output, self.answer(index, output))

    def answer(self, index: int, n: int) -> list[int]:
        return self.random(n, np.random.default_rng(index * 7919 + 17))

    def mooncake(self, index: int, t: float, hash_ids: Sequence[int], n_in: int,
                 output: int) -> SimRequest:
        need = -(-n_in // MOONCAKE_BLOCK)
        segs = [self._block(h) for h in hash_ids[:need]]
        ids = [tok for s in segs for tok in s][:n_in]
        hashes = self._segments.hashes(hash_ids[:need], segs, n_in)
        return SimRequest(index, t, ids, hashes, output, self.answer(index, output))

    def _block(self, hash_id: int) -> list[int]:
        """The tokens of Mooncake block ``hash_id``: a function of the id alone, distinct
        per id in its first two tokens (as ``PromptMaker.block``), the rest drawn by numpy
        (the words themselves do not matter here, only where blocks are identical)."""
        got = self._blocks.get(hash_id)
        if got is None:
            v = len(self.words)
            rest = np.random.default_rng(hash_id).integers(0, v, MOONCAKE_BLOCK - 2)
            got = [self.words[hash_id % v], self.words[(hash_id // v) % v],
                   *self._words[rest].tolist()]
            self._blocks[hash_id] = got
        return got


def build(spec: WorkloadSpec, b: Builder) -> list[SimRequest]:
    """Open-loop requests (trace or synthetic), in arrival order."""
    if spec.kind == "synthetic":
        rng = random.Random(spec.seed)
        n = spec.requests or 1_000_000
        times = workloads.gamma_arrivals(n, spec.rate, spec.burstiness, rng)
        ins = workloads.parse_lengths(spec.input_len, "input")
        outs = workloads.parse_lengths(spec.output_len, "output")
        plan = []
        for i, t in enumerate(times):
            if spec.duration_s is not None and t > spec.duration_s:
                break
            n_in, n_out = ins.sample(rng), outs.sample(rng)
            plan.append(b.request(i, t, b.ids(b.maker.random_ids(n_in, rng)), n_out))
        return plan
    if spec.trace is None:
        raise ValueError("a trace workload needs a trace file")
    path = Path(spec.trace)
    out: list[SimRequest] = []
    if path.suffix == ".jsonl":
        for i, row in enumerate(workloads.load_mooncake(path, spec.requests)):
            n_in = int(row["input_length"])
            if spec.max_input is not None:
                n_in = min(n_in, spec.max_input)
            out.append(b.mooncake(i, float(row["timestamp"]) / 1000.0 * spec.time_scale,
                                  row["hash_ids"], n_in, int(row["output_length"]) or 1))
    else:
        gen = np.random.default_rng(spec.seed)
        for i, r in enumerate(load_azure(path, limit=spec.requests)):
            n_in = min(r.input_tokens, spec.max_input) if spec.max_input else r.input_tokens
            out.append(b.request(i, r.t * spec.time_scale, b.random(n_in, gen),
                                 r.output_tokens))
    if spec.duration_s is not None:
        out = [r for r in out if r.t <= spec.duration_s]
    return out


class Conversations:
    """Multi-turn sessions: each turn is built when the previous one has been answered."""

    def __init__(self, spec: WorkloadSpec, b: Builder, counter: TokenCounter,
                 rate: float, burstiness: float) -> None:
        assert spec.sessions is not None
        self.b = b
        self.counter = counter
        self.sessions = _sessions(spec.sessions, rate, burstiness, b.maker, spec.seed)
        self.cap = spec.requests
        self.sent = 0
        self._index = 0
        self._seen: dict[int, int] = {}  # prompt tokens of each session's previous turn

    def first_turns(self) -> Iterator[tuple[int, float]]:
        for s in self.sessions:
            yield s.index, s.start

    def turn(self, session: int, turn: int, t: float, last_answer: str | None,
             on_done: Callable[[SimRequest], None]) -> SimRequest | None:
        if self.cap is not None and self.sent >= self.cap:
            return None
        s = self.sessions[session]
        messages = s.next_messages(turn, last_answer)
        prompt = _sync(self.counter.chat_prompt(messages))
        ids = [tok for piece in prompt.ids for tok in piece]
        n_out = s.outputs[turn]
        sr = self.b.request(self._index, t, ids, n_out)
        sr.fresh_tokens = len(ids) - self._seen.get(session, 0)
        self._seen[session] = len(ids)
        sr.result.prompt_tokens = prompt.tokens
        sr.on_done = on_done
        self._index += 1
        self.sent += 1
        return sr

    def answer_text(self, sr: SimRequest) -> str:
        tok = self.b.maker.tokenizer
        return "".join(tok.word_text(t) for t in sr.answer[:sr.result.output_tokens])


_SESSIONS: dict[tuple[Any, ...], list[workloads.Session]] = {}


def _sessions(spec: workloads.SessionSpec, rate: float, burstiness: float,
              maker: PromptMaker, seed: int) -> list[workloads.Session]:
    """``workloads.sessions``, its texts drawn once per (spec, rate, seed) in a process (a
    strategy matrix replays one schedule many times); every call gets fresh sessions."""
    key = (spec, rate, burstiness, seed, maker.tokenizer.name)
    made = _SESSIONS.get(key)
    if made is None:
        made = _SESSIONS[key] = workloads.sessions(spec, rate, burstiness, maker, seed)
        while len(_SESSIONS) > 4:
            _SESSIONS.pop(next(iter(_SESSIONS)))
    return [dataclasses.replace(s, messages=[]) for s in made]


def _sync(coro: Coroutine[Any, Any, Any]) -> Any:
    """Run a coroutine that never suspends (token counting without an executor)."""
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value
    coro.close()
    raise RuntimeError("token counting suspended: the simulator counts synchronously")
