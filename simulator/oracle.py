"""Hindsight bounds: what routing could have done, to read a strategy's result against.

* ``Hindsight`` routes each request to the endpoint where its *true* TTFT is lowest given
  everything already sent: it reads each simulated engine's exact state (its running batch,
  its waiting queue, the prefix cache blocks it really holds, the step under way) and plays
  the engine's chunked-prefill schedule forward with the timing model (no jitter, no future
  arrivals) until the request's first token. No decision-time predictor can know more
  without knowing the future.
* ``clairvoyant_floor`` also knows the future in the strongest sense: each request's TTFT if
  it had an idle engine to itself holding every block any earlier request of the trace
  computed (an ideal, unbounded shared cache), which no routing can beat.

The forward play is the scheduler's order (running sequences first, one token per decoding
sequence, then prefills in order under the step's token budget); it ignores KV capacity,
preemption and ``max_num_seqs``, which only lengthen a real schedule.
"""

from __future__ import annotations

from collections.abc import Sequence

from roofline.timing import TimingModel
from simulator.engine import SimEngine

_MAX_STEPS = 100_000


def _queue(e: SimEngine) -> tuple[list[tuple[int, int, int]], list[tuple[int, int]]]:
    """The engine's prefills ahead (tokens left, context, output left) and its decoding
    sequences (context, output left), in the scheduler's order; requests routed there and
    still on their way count as waiting."""
    prefills: list[tuple[int, int, int]] = []
    decodes: list[tuple[int, int]] = []
    for r in e.scheduler.running:
        out_left = max(r.target_output_tokens - r.num_output_tokens, 0)
        left = r.num_tokens - r.num_computed_tokens
        if r.num_output_tokens > 0 or left <= 1:
            decodes.append((r.num_tokens, out_left))
        else:
            prefills.append((left, r.num_computed_tokens, out_left))
    for r in [*e.scheduler.waiting, *e.incoming.values()]:
        hit = 0 if r.num_computed_tokens else e.kv.computed_blocks(r)[1]
        prefills.append((r.num_tokens - max(hit, r.num_computed_tokens), hit,
                         max(r.target_output_tokens - r.num_output_tokens, 0)))
    return prefills, decodes


def first_token_s(timing: TimingModel, budget: int, prefills: list[tuple[int, int, int]],
                  decodes: list[tuple[int, int]], start_s: float) -> float:
    """Seconds until the last of ``prefills`` samples its first token."""
    t = start_s
    pre = [list(p) for p in prefills]
    dec = [list(d) for d in decodes]
    for _ in range(_MAX_STEPS):
        room = budget - len(dec)
        tokens = pairs = kv = sampled = 0.0
        for d in dec:
            tokens += 1
            pairs += d[0]
            kv += d[0] + 1
        sampled = len(dec)
        seqs = len(dec)
        done: list[list[int]] = []
        for p in pre:
            if room <= 0:
                break
            n = min(p[0], room)
            room -= n
            tokens += n
            pairs += n * p[1] + n * (n + 1) / 2.0
            kv += p[1] + n
            seqs += 1
            p[0] -= n
            p[1] += n
            if p[0] <= 0:
                sampled += 1
                done.append(p)
        t += timing.aggregate(int(tokens), pairs, int(kv), seqs, int(sampled)).seconds
        if pre and pre[-1][0] <= 0:
            return t
        for d in dec:
            d[0] += 1
            d[1] -= 1
        dec = [d for d in dec if d[1] > 0] + [[p[1] + 1, p[2] - 1] for p in done if p[2] > 1]
        pre = [p for p in pre if p[0] > 0]
        if not pre:
            return t
    return t


class Hindsight:
    """The decision: for each candidate engine, the request's true first-token time."""

    def __init__(self, engines: dict[str, SimEngine]) -> None:
        self.engines = engines
        self._timing = {u: TimingModel(e.model, e.hardware, jitter=0.0)
                        for u, e in engines.items()}

    def ttft_s(self, url: str, hashes: Sequence[int], prompt: int, output: int,
               now: float) -> float:
        e = self.engines[url]
        e.sync()
        prefills, decodes = _queue(e)
        hit = 0
        max_blocks = (prompt - 1) // e.config.block_size
        for h in hashes[:max_blocks]:
            if e.pool.lookup(h) is None:  # type: ignore[arg-type]
                break
            hit += e.config.block_size
        prefills.append((prompt - hit, hit, output))
        return first_token_s(self._timing[url], e.config.max_num_batched_tokens, prefills,
                             decodes, max(e.step_end - now, 0.0))

    def pick(self, urls: Sequence[str], hashes: Sequence[int], prompt: int, output: int,
             now: float) -> str:
        return min(urls, key=lambda u: (self.ttft_s(u, hashes, prompt, output, now), u))


def clairvoyant_floor(timing: TimingModel, budget: int, block_size: int,
                      requests: Sequence[tuple[Sequence[int], int]]) -> list[float]:
    """Per request (its block hashes, prompt tokens), in arrival order: the lone prefill of
    what no earlier request computed, on an idle engine (seconds)."""
    seen: set[int] = set()
    out = []
    for hashes, prompt in requests:
        hit = 0
        for h in hashes[:(prompt - 1) // block_size]:
            if h not in seen:
                break
            hit += block_size
        seen.update(hashes)
        out.append(first_token_s(timing, budget, [(prompt - hit, hit, 1)], [], 0.0))
    return out
