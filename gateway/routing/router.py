"""One model's routing decision: prompt hashes → candidates → predictions → plugins → pick,
and for disaggregated pools, a prefill endpoint then a decode endpoint.

``Router.prepare`` works out what the decision needs about the request once (prompt block
hashes through the cached ``PromptHasher``); ``Router.decide`` is synchronous and cheap so it
can run again on a retry with the failed endpoints excluded, or while a request waits for its
SLO. Predictions for every candidate of a stage come from one predictor call; ``commit``
records the chosen endpoints' blocks in the approximate index when the request is sent.
"""

from __future__ import annotations

import dataclasses
import functools
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from gateway import clock as clk
from gateway.config.policy import Model
from gateway.counting.slots import CountingSlots
from gateway.counting.tokenize import ChatPrompt, TokenCounter
from gateway.routing import plugins
from gateway.routing.approx_index import ApproxIndex
from gateway.routing.endpoints import EndpointPool, EndpointState
from gateway.routing.fleet import Fleet
from gateway.routing.plugins import Candidate, PluginConfig, Profile, RequestInfo
from gateway.routing.prefix import PromptHasher
from predictor.features import DEFAULT_PREFILL_RATE, EndpointSnapshot, build_matrix
from predictor.online import OnlinePredictor
from predictor.prior import RooflinePrior
from protocol.kv_hash import root_hash
from roofline.profiles import HARDWARE, MODELS

SGLANG_TREE_TOKENS = 2**26 // 4  # sglang-router's max_tree_size in characters, ~4 per token

# The decode stage of a disaggregated pool: predicted TPOT first, free KV, and the share of
# the prompt the decode endpoint already holds (it pulls only the blocks it lacks, and a
# conversation's history stays where it decodes): in the strategy matrix the prefix term
# took agent sessions on 2P+2D at 40 % load from 74 % to 89 % goodput and changed no other
# P:D cell tried by more than noise.
_DECODE = Profile(("tpot_slo",), {"predicted_tpot": 2.0, "kv_free": 1.0, "prefix": 2.0},
                  "max_score")


# a prompt with this many tokens still to hash is hashed in the worker pool (~3 ms at the rate
# measured: 700,000 tokens in 135 ms)
T = TypeVar("T")
HASH_OFFLOAD_TOKENS = 16_384

@dataclass(slots=True)
class Decision:
    endpoint: Candidate  # the decode endpoint, or the only one
    prefill: Candidate | None = None  # set when the prompt is prefilled elsewhere
    strategy: str = ""
    considered: tuple[Candidate, ...] = ()  # the (decode) stage's candidates, for tracing

    @property
    def predicted_ttft_ms(self) -> float:
        c = self.prefill or self.endpoint
        return c.ttft_ms

    @property
    def predicted_tpot_ms(self) -> float:
        return self.endpoint.tpot_ms


@functools.cache
def _hw(name: str | None) -> tuple[float, float]:
    hw = HARDWARE.get(name or "")
    return (hw.hbm_bandwidth / 1e12, hw.peak_flops / 1e12) if hw else (0.0, 0.0)


def profile_for(model: Model) -> Profile:
    r = model.routing
    base = plugins.STRATEGIES[r.strategy]
    return Profile(r.filters if r.filters is not None else base.filters,
                   dict(r.scorers) if r.scorers is not None else base.scorers,
                   r.picker or base.picker)


class Router:
    def __init__(self, pool: EndpointPool, fleet: Fleet,
                 predictor: OnlinePredictor | None) -> None:
        self.pool = pool
        self.model = pool.model
        self.fleet = fleet
        self.predictor = predictor
        r = self.model.routing
        self.profile = profile_for(self.model)
        self.strategy = r.strategy
        self.rng = random.Random(r.seed)
        self.cfg = PluginConfig(load_factor=r.load_factor)
        self.cfg_prefill = PluginConfig(load_factor=r.load_factor)
        self.namespace = r.hash_namespace or self.model.backend.model
        self._hasher: PromptHasher | None = None
        self._priors: dict[str | None, RooflinePrior | None] = {}
        self.precise = r.index == "precise"
        # sglang-router's approximate tree is its own: every request it routed, sized by its
        # max_tree_size (2^26 characters, ~16M tokens), not by the engine's KV capacity; its
        # "smallest tree" rule needs that size to keep growing with what was routed.
        self._tree = ApproxIndex(SGLANG_TREE_TOKENS // (r.block_size or 16)) \
            if r.strategy == "sglang_cache_aware" else None
        if self.precise:
            fleet.want_precise({e.url: e.kv_events for e in self.model.endpoints},
                               root_hash(self.namespace))
        self.kv_pool = self.model.kv_pool.url if self.model.kv_pool is not None else None
        if self.model.kv_pool is not None:
            fleet.want_pool(self.model.kv_pool, root_hash(self.namespace), self.precise)

    @property
    def index(self) -> Any:
        if self._tree is not None:
            return self._tree
        return self.fleet.precise if self.precise else self.fleet.approx

    def block_size(self) -> int:
        if self.model.routing.block_size:
            return self.model.routing.block_size
        for e in self.pool.endpoints:
            if e.engine.block_size:
                return e.engine.block_size
        return 16

    def hasher(self) -> PromptHasher:
        bs = self.block_size()
        if self._hasher is None or self._hasher.block_size != bs:
            self._hasher = PromptHasher(self.namespace, bs)
        return self._hasher

    async def prepare(self, counter: TokenCounter, *, chat: ChatPrompt | None,
                      prompt_ids: Sequence[int] | None, prompt_text: str | None,
                      salt: str | None, prompt_tokens: int, expected_output: int,
                      slo_ttft_ms: float | None, slo_tpot_ms: float | None,
                      priority: str, slots: CountingSlots | None = None,
                      tenant: str = "") -> RequestInfo:
        """``slots``: hashing a long prompt in the worker pool takes one of ``tenant``'s
        counting slots, as counting it did (one tenant's huge prompts cannot fill the pool)."""
        h = self.hasher()
        # no full block, or engines that keep no prefix cache: nothing any cache could hold
        if prompt_tokens < h.block_size or self._no_prefix_cache():
            return RequestInfo(prompt_tokens, expected_output, (), h.block_size, slo_ttft_ms,
                               slo_tpot_ms, priority)
        hashes: Sequence[int]
        if chat is not None:
            job = h.resume(chat, salt)
            stable = await _hashed(counter, job.tokens >= HASH_OFFLOAD_TOKENS, slots, tenant,
                                   job.run)
            hashes = h.finish(job, stable)
        else:
            ids = prompt_ids if prompt_ids is not None else await counter.text_ids(
                prompt_text or "")
            hashes = await _hashed(counter, len(ids) >= HASH_OFFLOAD_TOKENS, slots, tenant,
                                   h.tokens, ids, salt)
        return RequestInfo(prompt_tokens, expected_output, hashes, h.block_size, slo_ttft_ms,
                           slo_tpot_ms, priority)

    def _no_prefix_cache(self) -> bool:
        """Every endpoint says it keeps no prefix cache (``cache_config_info``), as an
        embedding model with bidirectional attention does: prompts are then not hashed,
        matched or recorded."""
        eps = self.pool.endpoints
        return bool(eps) and all(e.engine.prefix_caching is False for e in eps)

    # -- decisions --------------------------------------------------------------------------

    def _candidates(self, req: RequestInfo, eps: list[EndpointState], role: str | None = None
                    ) -> list[Candidate]:
        index = self.index
        out = []
        bs = req.block_size
        tiered = self.model.routing.kv_tiers and self._tree is None and bool(req.hashes)
        precise = self.fleet.precise if self.precise else None
        last = max(req.prompt_tokens - 1, 0)
        name = self.model.upstream_name
        for e in eps:
            blocks = index.matched(e.url, req.hashes) if req.hashes else 0
            cached = min(blocks * bs, last)
            c = Candidate(e, cached, req.prompt_tokens - cached, matched_blocks=blocks,
                          index_blocks=index.size(e.url))
            # an engine shared by several models: switching this one in comes first; an
            # adapter it does not hold: loading it
            switch_ms = e.engine.model_wait_s.get(name, 0.0) * 1e3 \
                + self.fleet.adapters.cost_ms(self.model, e)
            if tiered and cached < last:
                t = self.fleet.tiers.lookup(e.url, e.engine, req.hashes, blocks, last // bs,
                                            self.kv_pool, precise)
                if t.host or t.pool:
                    c.host_tokens, c.pool_tokens = t.host * bs, t.pool * bs
                    c.load_ms = t.load_ms(e.engine, bs)
                    c.cached_tokens = min(cached + c.host_tokens + c.pool_tokens, last)
                    c.uncached_tokens = req.prompt_tokens - c.cached_tokens
            c.load_ms += switch_ms
            out.append(c)
        return out

    def _predict(self, req: RequestInfo, cands: list[Candidate], role: str | None = None
                 ) -> None:
        if self.predictor is None or not cands:
            return
        now = clk.now()
        snaps = []
        for c in cands:
            e = c.ep
            bw, tf = _hw(e.hardware)
            snaps.append(EndpointSnapshot(
                kv_usage=e.engine.kv_usage, running=e.engine.running, waiting=e.engine.waiting,
                in_flight=e.live.in_flight, prefill_tokens=e.live.prefill_tokens,
                decoding=e.live.decoding,
                oldest_pending_ms=e.live.oldest_pending_ms(now),
                prefill_queue_ms=e.live.prefill_queue_ms(now), prefill_rate=e.live.prefill_rate,
                prefill_arrivals=e.live.arrival_rate(now), step_ms=e.live.current_step_ms(now),
                recent_ttft_ms=e.live.recent_ttft_ms, recent_tpot_ms=e.live.recent_tpot_ms,
                role=role or e.role, hw_bandwidth_tbs=bw, hw_tflops=tf, load_ms=c.load_ms))
        priors = [self._prior(req, c, s) for c, s in zip(cands, snaps, strict=True)]
        x = build_matrix(req.prompt_tokens, req.expected_output,
                         [c.uncached_tokens for c in cands], snaps, priors)
        ttft, tpot = self.predictor.predict(x)
        p90 = self.predictor.tpot_p90_factor()
        for i, c in enumerate(cands):
            c.ttft_ms, c.tpot_ms, c.row = float(ttft[i]), float(tpot[i]), x[i]
            c.tpot_p90_ms = c.tpot_ms * p90

    def roofline(self, hardware: str | None) -> RooflinePrior | None:
        """The roofline prior of an endpoint of this hardware serving this pool's model
        (None when either profile is unknown: a real engine the policy says nothing of)."""
        if hardware not in self._priors:
            hw, model = HARDWARE.get(hardware or ""), MODELS.get(self.model.backend.model)
            tp = self.model.backend.tensor_parallel
            if model is not None and tp:
                model = dataclasses.replace(model, tensor_parallel=tp)
            budget = self.model.backend.max_num_batched_tokens or 8192
            self._priors[hardware] = RooflinePrior(model, hw, budget) \
                if hw is not None and model is not None else None
        return self._priors[hardware]

    def _prior(self, req: RequestInfo, c: Candidate, s: EndpointSnapshot
               ) -> tuple[float, float]:
        r = self.roofline(c.ep.hardware)
        if r is None:
            return 0.0, 0.0
        queued = s.prefill_queue_ms * (s.prefill_rate or DEFAULT_PREFILL_RATE)
        v = c.ep.engine
        held = v.kv_usage * v.num_gpu_blocks * v.block_size \
            if v.num_gpu_blocks and v.block_size and v.running else None
        ttft, tpot = r.estimate(req.prompt_tokens, c.uncached_tokens, req.expected_output,
                                max(s.decoding, s.running - (s.in_flight - s.decoding)),
                                queued, s.prefill_arrivals, s.role,
                                held / v.running if held is not None else None)
        return ttft + c.load_ms, tpot

    def _stage(self, profile: Profile, req: RequestInfo, eps: list[EndpointState],
               cfg: PluginConfig, role: str | None = None
               ) -> tuple[Candidate, list[Candidate]]:
        """The pick among ``eps``, and every candidate it was picked from. A lone candidate
        with no SLO to meet is not predicted: nothing would read its figures but the
        predictor's own learning and the first-token wait, which with nowhere else to go is
        the route's ``first_token_s``."""
        cands = self._candidates(req, eps, role)
        alone = (role is None and len(cands) == 1 and req.slo_ttft_ms is None
                 and req.slo_tpot_ms is None)
        if profile.needs_prediction and not alone:
            self._predict(req, cands, role)
        pick, _ = plugins.run(profile, req, cands, self.rng, cfg)
        if not profile.needs_prediction and not alone:
            self._predict(req, [pick], role)
        return pick, cands

    def decide(self, req: RequestInfo, exclude: Sequence[EndpointState] = ()
               ) -> Decision | None:
        pool = self.pool
        if not pool.disaggregated:
            eps = pool.candidates(exclude)
            if not eps:
                return None
            pick, cands = self._stage(self.profile, req, eps, self.cfg)
            return Decision(pick, None, self.strategy, tuple(cands))
        decoders = pool.candidates(exclude, roles=("decode", "both"))
        if not decoders:
            return None
        decode_profile = _DECODE if self.strategy == "predicted" else self.profile
        dec, cands = self._stage(decode_profile, req, decoders, self.cfg, "decode")
        considered = tuple(cands)
        prefill: Candidate | None = None
        if dec.uncached_tokens > self.model.routing.remote_prefill_min_tokens:
            prefillers = [e for e in pool.candidates(exclude, roles=("prefill", "both"))
                          if e is not dec.ep]
            if prefillers:
                prefill, _ = self._stage(self.profile, req, prefillers, self.cfg_prefill,
                                      "prefill")
            if prefill is not None and dec.ep.role == "both":
                # A decoder that also prefills computes the prompt itself when that is sooner.
                now = clk.now()
                if dec.ep.live.prefill_finish_ms(now, dec.uncached_tokens) <= \
                        prefill.ep.live.prefill_finish_ms(now, prefill.uncached_tokens):
                    prefill = None
        return Decision(dec, prefill, self.strategy, considered)

    def commit(self, d: Decision, req: RequestInfo) -> None:
        """The request is being sent as decided: its blocks are now where it goes (the
        approximate index learns only from decisions acted on, not from ones re-taken while
        a request waited for its SLO)."""
        if d.prefill is not None:
            self.index.record(d.prefill.ep.url, req.hashes, d.prefill.matched_blocks)
        self.index.record(d.endpoint.ep.url, req.hashes, d.endpoint.matched_blocks)
        if not self.precise and self._tree is None:
            computed = d.prefill if d.prefill is not None else d.endpoint
            self.fleet.tiers.record(computed.ep.url, computed.ep.engine, req.hashes,
                                    self.kv_pool)


async def _hashed(counter: TokenCounter, offload: bool, slots: CountingSlots | None,
                  tenant: str, fn: Callable[..., T], *args: Any) -> T:
    if not offload or slots is None:
        return await counter.in_pool(offload, fn, *args)
    async with slots.slot(tenant):
        return await counter.in_pool(True, fn, *args)
