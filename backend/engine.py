"""The engine loop: plans a step, lets it take its modelled time, then emits its tokens.

Real time is the simulated GPU's time. A step planned at ``start`` ends at
``start + duration · time_scale``; the loop sleeps until then, applies the step and plans the
next one from the previous step's *planned* end, so timer rounding (asyncio wakes up to a
millisecond late) delays token delivery slightly but never accumulates into the timeline. Only
when the loop is more than ``resync_s`` behind (it cannot keep up with the load it is given)
does it restart the timeline from the present; the lag is measured at every step.

Requests enter through ``submit`` and leave through their ``RequestStream``. Aborts (client
disconnects, cancellations) are applied between steps so a step never sees freed blocks.
A request with ``remote_decode`` (prefill role) keeps its blocks after finishing, until a decode
instance pulls and releases them or ``kv_hold_timeout_s`` passes. A request with
``remote_prefill`` (decode role) pulls its prompt's KV through ``kv_puller`` before decoding.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from backend.block_pool import KVBlock
from backend.engine_config import EngineConfig, multiplexer
from backend.events import KVEventPublisher
from backend.kv_offload import KVTiers
from backend.kv_tiers import TierWalk
from backend.model_slot import ModelSlot
from backend.pooling import PoolingConfig, Turn
from backend.request import Request, Status
from backend.scheduler import StepPlan
from backend.stream import RequestStream
from backend.textgen import WordSource
from protocol.tokenizer import Tokenizer
from roofline.profiles import HardwareProfile, ModelProfile

log = logging.getLogger("tokengate.backend")

Clock = Callable[[], float]
KVPuller = Callable[[Request], Awaitable[bool]]


@dataclass(slots=True)
class HeldKV:
    """Blocks a prefill instance keeps for a decode instance to pull."""

    blocks: list[KVBlock]
    num_tokens: int
    expires_at: float
    last_block_hash: int | None


@dataclass(slots=True)
class StepObserver:
    """Callbacks the metrics layer installs; every one is optional."""

    on_step: Callable[[StepPlan, float, float], None] | None = None  # plan, duration, lag
    on_token: Callable[[Request, float], None] | None = None  # request, now
    on_finish: Callable[[Request, float], None] | None = None
    on_preempt: Callable[[Request], None] | None = None


@dataclass(slots=True)
class _Entry:
    req: Request
    stream: RequestStream
    words: WordSource


@dataclass(slots=True)
class LagStats:
    steps: int = 0
    total_s: float = 0.0
    max_s: float = 0.0
    resyncs: int = 0
    busy_s: float = 0.0  # modelled time the GPU was busy

    def add(self, lag: float) -> None:
        self.steps += 1
        self.total_s += lag
        self.max_s = max(self.max_s, lag)


class Engine:
    def __init__(
        self,
        model: ModelProfile,
        hardware: HardwareProfile,
        tokenizer: Tokenizer,
        config: EngineConfig,
        *,
        clock: Clock = time.monotonic,
        observer: StepObserver | None = None,
        pooling: PoolingConfig | None = None,
        hosted: dict[str, ModelProfile] | None = None,
    ) -> None:
        self.model = model
        self.hardware = hardware
        self.tokenizer = tokenizer
        self.config = config
        self.clock = clock
        self.observer = observer or StepObserver()
        self.mux = multiplexer(model, hardware, config, pooling, hosted or {})
        primary = self.mux.slots[0]
        self.pool = primary.pool
        self.kv = primary.kv
        self.scheduler = primary.scheduler
        self.timing = primary.timing
        self.kv_puller: KVPuller | None = None
        self.tiers: KVTiers | None = None  # host memory and the shared pool (``use_tiers``)
        self.extra_step_s = 0.0  # fault injection: a slow GPU
        self.lag = LagStats()
        self.held: dict[str, HeldKV] = {}
        self.kv_events = KVEventPublisher(config.block_size)
        self._entries: dict[str, _Entry] = {}
        self.submitted = 0  # requests ever submitted (admin/state; tests)
        self._aborts: set[str] = set()
        self._wake = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()
        self._anchor: float | None = None
        self.failed: BaseException | None = None

    def slot_of(self, req: Request) -> ModelSlot:
        return self.mux.by_name.get(req.model) or self.mux.slots[0]

    def use_tiers(self, tiers: KVTiers) -> None:
        """Look prompts up in host memory and the shared pool below the GPU prefix cache."""
        self.tiers = tiers
        self.scheduler.tiers = TierWalk(tiers.host)

    @property
    def capacity_tokens(self) -> int:
        return self.pool.num_blocks * self.config.block_size

    def knows(self, request_id: str) -> bool:
        """Whether the id is in flight or holds KV for a decode instance."""
        return request_id in self._entries or request_id in self.held

    def num_in_flight(self) -> int:
        return len(self._entries)

    def requests(self) -> list[Request]:
        return [e.req for e in self._entries.values()]

    def submit(self, req: Request, stream: RequestStream, words: WordSource) -> None:
        if self.failed is not None:
            raise RuntimeError("the engine has failed")
        if req.request_id in self._entries:
            raise ValueError(f"duplicate request id {req.request_id!r}")
        self._entries[req.request_id] = _Entry(req, stream, words)
        self.submitted += 1
        if self.tiers is not None and self.tiers.pool_url is not None \
                and self.config.enable_prefix_caching:
            self._spawn(self._admit(req))
            return
        self.slot_of(req).scheduler.add(req)
        self._wake.set()

    async def _admit(self, req: Request) -> None:
        """Ask the pool how much of the prompt it holds, then queue the request."""
        assert self.tiers is not None
        self.kv.update_hashes(req)
        try:
            await self.tiers.admit(req, req.block_hashes)
        finally:
            if req.request_id in self._entries and req.request_id not in self._aborts:
                self.scheduler.add(req)
                self._wake.set()

    def abort(self, request_id: str) -> None:
        """Cancel a request (client gone); takes effect before the next step."""
        if request_id in self._entries:
            self._aborts.add(request_id)
            self._wake.set()

    # -- prefill/decode handoff, prefill side --------------------------------------------
    def pull_held(self, request_id: str, block_ids: list[int] | None) -> HeldKV | None:
        held = self.held.get(request_id)
        if held is None:
            return None
        if block_ids is not None and block_ids != [b.block_id for b in held.blocks]:
            return None
        return held

    def release_held(self, request_id: str) -> bool:
        held = self.held.pop(request_id, None)
        if held is None:
            return False
        self.pool.free(reversed(held.blocks))
        self._wake.set()
        return True

    def _expire_held(self, now: float) -> None:
        for rid in [r for r, h in self.held.items() if h.expires_at <= now]:
            log.warning("freeing KV of %s: no decode instance pulled it in time", rid)
            self.release_held(rid)

    # -- the loop --------------------------------------------------------------------------
    async def run(self) -> None:
        """Run steps forever. A bug inside a step fails every request in flight (their clients
        get an error, never a hang) and marks the engine failed, so health checks turn red."""
        try:
            await self._loop()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.exception("engine loop failed")
            self.failed = exc
            for entry in list(self._entries.values()):
                entry.stream.close(Status.FINISHED_ABORTED, "engine failure")
            self._entries.clear()
            raise

    async def _loop(self) -> None:
        while True:
            events = [e for s in self.mux.slots for e in s.pool.drain_events()]
            if events:
                if self.tiers is not None:
                    events += self.tiers.on_computed(events)
                self.kv_events.publish(events)
            self._apply_aborts()
            self._expire_held(self.clock())
            turn = self.mux.next(self.clock()) if self.mux.has_work() else None
            if turn is None:
                await self._idle()
                continue
            plan = turn.plan
            for req in [*turn.dropped, *plan.preempted]:
                if self.observer.on_preempt:
                    self.observer.on_preempt(req)
            for req in plan.transfers:
                self._spawn(self._transfer(req))
            for req in plan.loads:
                self._spawn(self._load(req))
            if plan.empty and not turn.switch_s:
                await self._idle()
                continue
            await self._execute(turn)

    async def _idle(self) -> None:
        self._anchor = None
        self._wake.clear()
        if self._aborts:
            return
        timeout = 1.0 if self.held else None
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wake.wait(), timeout)

    async def _execute(self, turn: Turn) -> None:
        plan = turn.plan
        now = self.clock()
        start = now
        if self._anchor is not None and now - self._anchor <= self.config.resync_s:
            start = self._anchor
        elif self._anchor is not None:
            self.lag.resyncs += 1
        duration = turn.switch_s
        if not plan.empty:
            duration += turn.slot.timing.step_seconds(plan.work(), plan.num_sampled())
        scaled = duration * self.config.time_scale + self.extra_step_s
        target = start + scaled
        delay = target - self.clock()
        if delay > 0:
            await asyncio.sleep(delay)
        now = self.clock()
        lag = max(0.0, now - target)
        self.lag.add(lag)
        self.lag.busy_s += duration
        self._anchor = target
        if self.observer.on_step:
            self.observer.on_step(plan, duration, lag)
        self._apply(turn.slot, plan, now)

    def _apply(self, slot: ModelSlot, plan: StepPlan, now: float) -> None:
        for req in slot.scheduler.update(plan):
            entry = self._entries.get(req.request_id)
            if entry is None:
                continue
            token = entry.words.next()
            status = req.append_output(token)
            if entry.stream.push(token, self.tokenizer.word_text(token)):
                status = Status.FINISHED_STOPPED
            if req.first_token_time is None:
                req.first_token_time = now
            if self.observer.on_token:
                self.observer.on_token(req, now)
            req.last_token_time = now
            if status is not None:
                self._finish(entry, status, now)

    def _finish(self, entry: _Entry, status: Status, now: float) -> None:
        req = entry.req
        keep = req.remote_decode and status is not Status.FINISHED_ABORTED
        self.slot_of(req).scheduler.finish(req, status, keep_blocks=keep)
        if keep:
            blocks = self.kv.take(req.request_id)
            full = req.num_prompt_tokens // self.config.block_size
            last = req.block_hashes[full - 1] if full and len(req.block_hashes) >= full else None
            self.held[req.request_id] = HeldKV(blocks, req.num_prompt_tokens,
                                               now + self.config.kv_hold_timeout_s, last)
            entry.stream.kv_transfer_params = {"block_ids": [b.block_id for b in blocks]}
        del self._entries[req.request_id]
        if self.observer.on_finish:
            self.observer.on_finish(req, now)
        entry.stream.close(status)

    def _apply_aborts(self) -> None:
        if not self._aborts:
            return
        aborts, self._aborts = self._aborts, set()
        now = self.clock()
        for rid in aborts:
            entry = self._entries.get(rid)
            if entry is not None:
                self._finish(entry, Status.FINISHED_ABORTED, now)

    async def _transfer(self, req: Request) -> None:
        ok = False
        try:
            if self.kv_puller is not None:
                ok = await self.kv_puller(req)
        except Exception:
            log.exception("KV pull for %s failed; recomputing the prompt", req.request_id)
            ok = False
        self.scheduler.remote_kv_ready(req, ok)
        self._wake.set()

    async def _load(self, req: Request) -> None:
        blocks = 0
        hit = req.tier_hit
        try:
            if self.tiers is not None and hit is not None:
                blocks = await self.tiers.load(req, hit)
        except Exception:
            log.exception("KV load for %s failed; computing the prompt", req.request_id)
            blocks = 0
        self.scheduler.tier_loaded(req, blocks)
        self._wake.set()

    def _spawn(self, coro: Awaitable[None]) -> None:
        task: asyncio.Task[None] = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
