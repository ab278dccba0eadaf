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
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from backend.block_pool import BlockPool, KVBlock, KVEvent
from backend.engine import EngineConfig, num_gpu_blocks
from backend.profiles import HardwareProfile, ModelProfile
from backend.request import Request, Status
from backend.scheduler import Scheduler, SchedulerConfig, StepPlan
from backend.timing import TimingModel
from protocol.kv_hash import BlockHash
from simulator.events import EventLoop
from simulator.hashing import SimKVCacheManager


@dataclass(slots=True)
class Hooks:
    """What the simulated gateway learns from an engine (every callback gets the virtual
    time): a token of a request (``first`` for its first), a finished request."""

    on_token: Callable[[Request, float, bool], None]
    on_finish: Callable[[Request, float], None]
    answer: Sequence[int] = ()  # the tokens to generate (a conversation sends them back)


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
    on_kv_events: Callable[[list[KVEvent]], None] | None = None
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

    def __post_init__(self) -> None:
        cfg = self.config
        blocks = cfg.num_gpu_blocks or num_gpu_blocks(self.model, self.hardware, cfg)
        if blocks <= 0:
            raise ValueError(f"model {self.model.name} does not fit on {self.hardware.name}")
        self.pool = BlockPool(blocks, enable_caching=cfg.enable_prefix_caching,
                              record_events=False)
        self.kv = SimKVCacheManager(self.pool, cfg.block_size, BlockHash(self.root))
        self.scheduler = Scheduler(SchedulerConfig(cfg.max_num_batched_tokens,
                                                   cfg.max_num_seqs, cfg.block_size), self.kv)
        self.timing = TimingModel(self.model, self.hardware, jitter=cfg.jitter, seed=cfg.seed)

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
        self.scheduler.add(req)
        self._wake()

    def _wake(self) -> None:
        if not self._stepping:
            self._stepping = True
            self.loop.at(self.loop.now, self._step)

    def _step(self) -> None:
        now = self.loop.now
        if self.pool.events and self.on_kv_events is not None:
            self.on_kv_events(self.pool.drain_events())
        sched = self.scheduler
        if not sched.has_work():
            self._stepping = False
            return
        plan = sched.schedule(now)
        self.stats.preemptions += len(plan.preempted)
        for req in plan.transfers:
            self._pull(req)
        if plan.empty:
            self._stepping = False
            return
        duration = self.timing.step_seconds(plan.work(), plan.num_sampled())
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
        self.scheduler.remote_kv_ready(req, ok)
        self._wake()

