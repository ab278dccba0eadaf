"""One reference backend on the simulator's clock: ``backend.engine.Engine``'s loop, event by
event, around the backend's own ``Scheduler``, KV cache manager, ``BlockPool`` and
``TimingModel``.

A step is planned when the engine has work, takes ``TimingModel.step_seconds`` of virtual time
(jitter included, seeded as the real backend seeds it), and is then applied: tokens are
sampled, finished requests leave (a prefill-role request keeps its blocks for the decode
instance that will pull them), and the next step is planned at once. The real engine also
plans from the previous step's planned end, so virtual time is its timeline without the timer
rounding and event-loop lag of a busy machine. KV events (the pool's stored/removed blocks)
are handed out at the start of each step, as the real engine publishes them. A decode-role
request's KV pull takes ``latency + uncached prompt bytes / link``, as ``backend.pd`` models it.

A decode-only batch runs as one ``simulator.decode_run`` (its steps laid out ahead and
applied when the engine's state is read or changed) instead of one event per step: the
same steps, durations, blocks, tokens and KV events, at a fraction of the cost. Whoever reads
an engine's state (the gateway's scrape and decisions, the oracle) calls ``sync`` first.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from backend.block_pool import BlockPool, KVBlock, KVEvent
from backend.engine_config import EngineConfig, num_gpu_blocks
from backend.kv_tiers import CPU, POOL, HostTier, LoadCost, TierStats, TierWalk, computed_blocks
from backend.kvpool_store import PoolBlock, PoolStore
from backend.request import Request, Status
from backend.scheduler import Scheduler, SchedulerConfig, StepPlan
from protocol.kv_hash import BlockHash
from roofline.profiles import HardwareProfile, ModelProfile
from roofline.timing import TimingModel
from simulator.decode_run import ALLOC, DecodeRun, decode_only, layout
from simulator.events import EventLoop
from simulator.hashing import SimKVCacheManager


@dataclass(slots=True)
class Hooks:
    """What the simulated gateway learns from an engine (every callback gets the virtual
    time): a token of a request (``first`` for its first), a finished request; optionally
    the later tokens of a decode run at once (their times, in order)."""

    on_token: Callable[[Request, float, bool], None]
    on_finish: Callable[[Request, float], None]
    answer: Sequence[int] = ()  # the tokens to generate (a conversation sends them back)
    on_tokens: Callable[[Request, Sequence[float]], None] | None = None


@dataclass(slots=True)
class EngineStats:
    steps: int = 0
    busy_s: float = 0.0
    preemptions: int = 0
    transfers: int = 0
    transfer_s: float = 0.0


@dataclass(slots=True)
class SimEngine:
    url: str
    model: ModelProfile
    hardware: HardwareProfile
    config: EngineConfig
    loop: EventLoop
    root: int
    role: str = "both"
    kv_link_bps: float = 200e9
    kv_link_latency_s: float = 100e-6
    # the KV events of a step, with when the engine published them (the step's end)
    on_kv_events: Callable[[list[KVEvent], float], None] | None = None
    fast_forward: bool = True  # decode-only batches as runs (False: one event per step)
    # set: a run's tokens are counted here as they are applied, and each request's hooks get
    # their times (``on_tokens``) when the run ends, which is all a reader needs before then
    on_streamed: Callable[[int], None] | None = None
    pool: BlockPool = field(init=False)
    kv: SimKVCacheManager = field(init=False)
    scheduler: Scheduler = field(init=False)
    timing: TimingModel = field(init=False)
    stats: EngineStats = field(default_factory=EngineStats)
    held: dict[str, list[KVBlock]] = field(default_factory=dict)
    hooks: dict[str, Hooks] = field(default_factory=dict)
    peers: dict[str, SimEngine] = field(default_factory=dict)  # prefill engines by url
    _stepping: bool = False
    step_end: float = 0.0  # when the step under way ends (the hindsight oracle reads it)
    # requests routed here and still on their way (the oracle counts them): id -> request
    incoming: dict[str, Request] = field(default_factory=dict)
    run: DecodeRun | None = None
    _spare: deque[float] = field(default_factory=deque)  # jitter drawn for steps cut off
    # lower KV tiers (``use_tiers``): host memory of its own, a pool shared with its peers
    host: HostTier | None = None
    kv_pool: PoolStore | None = None
    cost: LoadCost | None = None
    tier_stats: dict[str, TierStats] = field(default_factory=dict)
    on_pool_events: Callable[[list[KVEvent], float], None] | None = None

    def __post_init__(self) -> None:
        cfg = self.config
        blocks = cfg.num_gpu_blocks or num_gpu_blocks(self.model, self.hardware, cfg)
        if blocks <= 0:
            raise ValueError(f"model {self.model.name} does not fit on {self.hardware.name}")
        self.pool = BlockPool(blocks, enable_caching=cfg.enable_prefix_caching,
                              record_events=False)
        self.kv = SimKVCacheManager(self.pool, cfg.block_size, BlockHash(self.root))
        self.scheduler = Scheduler(SchedulerConfig(
            cfg.max_num_batched_tokens, cfg.max_num_seqs, cfg.block_size,
            policy=cfg.scheduling_policy), self.kv)
        self.timing = TimingModel(self.model, self.hardware, jitter=cfg.jitter, seed=cfg.seed)

    def use_tiers(self, host_bytes: float, pool: PoolStore | None) -> None:
        """Host memory for KV below the GPU cache, and/or the shared pool (as the backend's
        ``--kv-offload-gb`` and ``--kv-pool``: ``backend.kv_tiers``)."""
        self.cost = LoadCost.of(self.model, self.hardware, self.kv_link_bps,
                                self.kv_link_latency_s)
        bs = self.config.block_size
        if host_bytes > 0:
            self.host = HostTier(max(int(host_bytes // (self.model.kv_bytes_per_token * bs)),
                                     1))
        self.kv_pool = pool
        self.tier_stats = {CPU: self.host.stats if self.host else TierStats(),
                           POOL: TierStats()}
        self.scheduler.tiers = TierWalk(self.host)
        self.pool.record_events = True

    @property
    def block_bytes(self) -> int:
        return int(self.model.kv_bytes_per_token * self.config.block_size)

    def _drain(self, at: float) -> None:
        """The GPU cache's events of a step: stored in the lower tiers, then handed out."""
        events = self.pool.drain_events()
        if self.host is not None:
            events += self.host.store(events)
        pool = self.kv_pool
        if pool is not None:
            nbytes, bs = self.block_bytes, self.config.block_size
            for h, parent, _, _ in computed_blocks(events, bs):
                pool.put(h, PoolBlock(parent, (), None, nbytes, bs))
            published = pool.drain_events()
            if published and self.on_pool_events is not None:
                self.on_pool_events(published, at)
        if events and self.on_kv_events is not None:
            self.on_kv_events(events, at)

    def _load(self, req: Request) -> None:
        hit = req.tier_hit
        assert hit is not None and self.cost is not None
        bs = self.config.block_size
        if hit.pool and self.kv_pool is not None:
            first = hit.gpu + hit.host
            hit.fetched = self.kv_pool.fetch(req.block_hashes[first:first + hit.pool])[0]
        seconds = self.cost.seconds(hit.host * bs, hit.fetched * bs)
        for medium, blocks in ((CPU, hit.host), (POOL, hit.fetched)):
            self.tier_stats[medium].count_load(blocks * bs, blocks * self.block_bytes)
        self.loop.after(seconds, self._loaded, req, hit.host + hit.fetched)

    def _loaded(self, req: Request, blocks: int) -> None:
        self._cut()
        self.scheduler.tier_loaded(req, blocks)
        self._wake()

    # -- what the gateway's scrape reads (the backend's /metrics gauges) -------------------
    @property
    def running(self) -> int:
        return len(self.scheduler.running)

    @property
    def waiting(self) -> int:
        return len(self.scheduler.waiting)

    def kv_usage(self) -> float:
        return self.pool.usage()

    # -- requests ----------------------------------------------------------------------------
    def submit(self, req: Request, hooks: Hooks) -> None:
        self.incoming.pop(req.request_id, None)
        self.hooks[req.request_id] = hooks
        self._cut()
        if self.kv_pool is not None and self.config.enable_prefix_caching:
            self.kv.update_hashes(req)
            req.pool_prefix = self.kv_pool.lookup(req.block_hashes)
        self.scheduler.add(req)
        self._wake()

    def _wake(self) -> None:
        if not self._stepping:
            self._stepping = True
            self.loop.at(self.loop.now, self._step)

    def _step(self) -> None:
        now = self.loop.now
        if self.pool.events:
            self._drain(now)
        sched = self.scheduler
        if not sched.has_work():
            self._stepping = False
            return
        plan = sched.schedule(now)
        self.stats.preemptions += len(plan.preempted)
        for req in plan.transfers:
            self._pull(req)
        for req in plan.loads:
            self._load(req)
        if plan.empty:
            self._stepping = False
            return
        if self.fast_forward and decode_only(plan, sched):
            run = layout(plan, lambda r: len(self.kv.blocks_of(r.request_id)),
                         self.pool.num_free, self.config.block_size, self.timing,
                         self._factor, now)
            if run is not None:
                self.run = run
                self.step_end = run.ends[0]
                self.loop.at(run.ends[-1], self._run_end, run, run.gen)
                return
        duration = self.timing.step_seconds(plan.work(), plan.num_sampled(), self._factor)
        self.stats.steps += 1
        self.stats.busy_s += duration
        self.step_end = now + duration
        self.loop.after(duration, self._apply, plan)

    def _apply(self, plan: StepPlan) -> None:
        now = self.loop.now
        for req in self.scheduler.update(plan):
            first = req.first_token_time is None
            hooks = self.hooks.get(req.request_id)
            k = req.num_output_tokens
            answer = hooks.answer if hooks is not None else ()
            status = req.append_output(int(answer[k]) if k < len(answer) else 1000 + k)
            if first:
                req.first_token_time = now
            req.last_token_time = now
            if hooks is not None:
                hooks.on_token(req, now, first)
            if status is not None:
                self._finish(req, status, now)
        self._step()

    def _factor(self) -> float:
        return self._spare.popleft() if self._spare else self.timing.noise()

    # -- decode runs -------------------------------------------------------------------------
    def sync(self) -> None:
        """Apply the steps of the run under way that have ended by now."""
        run = self.run
        if run is not None:
            self._advance(run, bisect.bisect_right(run.ends, self.loop.now))

    def _cut(self) -> None:
        """The batch may change after the step under way: the run ends with it."""
        run = self.run
        if run is None:
            return
        self.sync()
        keep = run.done + 1
        if keep < run.steps:
            self._spare.extendleft(reversed(run.cut(keep)))
            self.loop.at(run.ends[-1], self._run_end, run, run.gen)

    def _run_end(self, run: DecodeRun, gen: int) -> None:
        if self.run is not run or run.gen != gen:
            return  # cut short: a later event ends it
        self._advance(run, run.steps)
        self._tell(run)
        self.run = None
        now = self.loop.now
        for req in run.batch:
            status = req.finish_status()
            if status is not None:
                self._finish(req, status, now)
        self._step()

    def _advance(self, run: DecodeRun, upto: int) -> None:
        """Apply steps ``run.done + 1`` to ``upto`` as stepping would have, and plan the next
        (its blocks)."""
        upto = min(upto, run.steps)
        first = run.done
        if upto <= first:
            return
        n = upto - first
        last = run.ends[upto - 1]
        for req in run.batch:
            hooks = self.hooks.get(req.request_id)
            answer = hooks.answer if hooks is not None else ()
            k = len(req.token_ids) - len(req.prompt_token_ids)
            m = len(answer)
            req.token_ids.extend([int(answer[x]) if x < m else 1000 + x
                                  for x in range(k, k + n)])
            req.last_token_time = last
        if self.on_streamed is not None:
            self.on_streamed(n * len(run.batch))
        else:
            self._tell(run, upto)
        # blocks for the step under way were taken when it was planned, as stepping does
        kv, events = self.kv, run.events
        i, step = run.next_event, first + 1
        while i < len(events) and (events[i][0] <= upto or
                                   (events[i][0] == upto + 1 and events[i][1] == ALLOC)):
            j, kind, s = events[i]
            if j != step:
                if self.pool.events:
                    self._drain(run.ends[step - 1])
                step = j
            req = run.batch[s]
            if kind == ALLOC:
                req.num_computed_tokens = run.c0[s] + j - 1
                if not kv.allocate_slots(req, 1):
                    raise AssertionError("a decode run ran out of blocks it counted")
            else:
                kv.cache_computed(req, run.c0[s] + j)
            i += 1
        if self.pool.events:
            self._drain(run.ends[step - 1])
        run.next_event = i
        for req, c in zip(run.batch, run.c0, strict=True):
            req.num_computed_tokens = c + upto
        busy = self.stats.busy_s
        for d in run.durations[first:upto]:
            busy += d
        self.stats.busy_s = busy
        self.stats.steps += n
        run.done = upto
        self.step_end = run.ends[upto] if upto < run.steps else run.ends[-1]

    def _tell(self, run: DecodeRun, upto: int | None = None) -> None:
        """Hand each request's hooks the times of its tokens not yet told."""
        upto = run.done if upto is None else upto
        if upto <= run.told:
            return
        times = run.ends[run.told:upto]
        run.told = upto
        for req in run.batch:
            hooks = self.hooks.get(req.request_id)
            if hooks is None:
                continue
            if hooks.on_tokens is not None:
                hooks.on_tokens(req, times)
            else:
                for t in times:
                    hooks.on_token(req, t, False)

    def _finish(self, req: Request, status: Status, now: float) -> None:
        keep = req.remote_decode
        self.scheduler.finish(req, status, keep_blocks=keep)
        if keep:
            self.held[req.request_id] = self.kv.take(req.request_id)
        hooks = self.hooks.pop(req.request_id, None)
        if hooks is not None:
            hooks.on_finish(req, now)

    def release_held(self, request_id: str) -> None:
        blocks = self.held.pop(request_id, None)
        if blocks is not None:
            self.sync()  # the run's allocations so far came from the queue before this
            self.pool.free(reversed(blocks))
            self._wake()

    # -- prefill/decode: the decode side pulls the prompt's KV -----------------------------
    def _pull(self, req: Request) -> None:
        rp = req.remote_prefill
        assert rp is not None
        peer = self.peers.get(str(rp.params.get("remote_url")))
        ok = peer is not None and req.request_id in peer.held
        tokens = req.num_prompt_tokens - rp.hit_tokens
        link = self.kv_link_latency_s + tokens * self.model.kv_bytes_per_token * 8 \
            / self.kv_link_bps
        self.stats.transfers += 1
        self.stats.transfer_s += link
        self.loop.after(link if ok else 0.0, self._pulled, req, peer, ok, tokens)

    def _pulled(self, req: Request, peer: SimEngine | None, ok: bool, tokens: int) -> None:
        if ok and req.remote_prefill is not None:
            req.remote_prefill.pulled_tokens = tokens
        if peer is not None:
            peer.release_held(req.request_id)
        self._cut()
        self.scheduler.remote_kv_ready(req, ok)
        self._wake()

