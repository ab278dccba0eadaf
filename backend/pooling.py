"""Several models on one instance: which model runs the next step, and what switching costs.

Each hosted model keeps its own vLLM-style ``Scheduler``, KV cache manager and block pool
(KV blocks are per model: their shapes differ). The instance's GPU memory is one budget: the
weights of the *resident* models plus the KV blocks every model's requests reference. A model
runs a step only when its weights are resident; bringing them in costs
``SwitchCost.load_seconds`` and may first drop other models' weights (least recently used, idle
ones first) and, only if that is not enough, the KV of other models' requests (they are
preempted and recompute later). The model that runs may allocate only the memory left by the
others: its pool withholds the rest (``BlockPool.reserve``), so its own scheduler preempts
within its share exactly as vLLM does when its cache is full; withholding more forgets the
model's least recently used cached prefixes, which is what another model's use of that memory
would do.

Three policies pick the model of the next step (``MODES``):

- ``dedicated``: one model, never a switch.
- ``request``: switch only when the running batch has drained (ServerlessLLM-style
  request-level auto-scaling); then the model whose waiting request arrived first.
- ``token``: Aegaeon's token-level scheduling, between any two steps. Every request has a
  deadline: its first token at ``arrival + ttft_slo`` (less its prefill time), its n-th token
  at ``first token + n · tpot_slo`` (the TPOT SLO as an average: tokens decoded early bank
  slack); a prompt that can no longer make its TTFT goes by its late deadline (``arrival +
  ttft_slo + its prefill``), behind those that still can. Prefill is served
  first-come-first-served per model, grouped (a model's waiting prompts go in one batch),
  whenever the slack of the running decodes pays for the detour
  (switch there, prefill, switch back); otherwise the running models take turns by earliest
  deadline, and the current one keeps the GPU until another's deadline comes within the cost
  of switching to it (plus one TPOT): weighted round-robin whose quanta follow the deadlines.
  A model whose weights had to be loaded keeps the GPU, while it has work, for ``QUANTUM``
  times the load's cost, so switching never takes more than 1/(1+QUANTUM) of the GPU's time
  however late everyone is (EDF alone would switch at every step under overload).

Pure and synchronous: the reference backend's engine loop and the simulator drive the same
object and charge ``Turn.switch_s`` as GPU time before the step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from backend.model_slot import ModelSlot
from backend.request import Request
from backend.scheduler import StepPlan
from roofline.profiles import HardwareProfile
from roofline.switching import SwitchCost

Mode = Literal["dedicated", "request", "token"]
# token mode: a model whose weights were loaded to switch it in keeps the GPU (while it has
# work) for QUANTUM times the load's cost, so loading costs at most 1/(1+QUANTUM) of the time
QUANTUM = 4.0
MODES: tuple[Mode, ...] = ("dedicated", "request", "token")


@dataclass(frozen=True, slots=True)
class PoolingConfig:
    """The models one instance hosts (served name, profile name) and how they share it."""

    models: tuple[tuple[str, str], ...]
    mode: Mode = "token"
    switch: SwitchCost = field(default_factory=SwitchCost)
    ttft_slo_s: float = 2.0
    tpot_slo_s: float = 0.05


@dataclass(slots=True)
class SwitchStats:
    switches: int = 0  # weight loads
    switch_s: float = 0.0  # modelled seconds spent loading weights
    turns: int = 0  # changes of the running model (a load or a resident model's turn)
    weight_evictions: int = 0
    kv_drops: int = 0  # requests whose KV was dropped to make room for another model


@dataclass(slots=True)
class Turn:
    """The next step: which model runs ``plan``, after ``switch_s`` seconds of weight loading;
    ``dropped``: other models' requests whose KV was dropped to make room (preempted)."""

    slot: ModelSlot
    plan: StepPlan
    switch_s: float = 0.0
    dropped: list[Request] = field(default_factory=list)


class Multiplexer:
    """The models of one instance and the policy that time-shares the GPU among them."""

    def __init__(self, slots: list[ModelSlot], *, mode: Mode, hardware: HardwareProfile,
                 capacity: float, switch: SwitchCost | None = None,
                 ttft_slo_s: float = 2.0, tpot_slo_s: float = 0.05,
                 time_scale: float = 1.0) -> None:
        if not slots:
            raise ValueError("an instance hosts at least one model")
        if mode not in MODES:
            raise ValueError(f"pooling mode must be one of {', '.join(MODES)}, not {mode!r}")
        if mode == "dedicated" and len(slots) > 1:
            raise ValueError("dedicated pooling hosts exactly one model; use request or token "
                             "to share an instance")
        names = [s.name for s in slots]
        if len(set(names)) != len(names):
            raise ValueError(f"a model is listed twice: {', '.join(names)}")
        tps = {max(s.profile.tensor_parallel, 1) for s in slots}
        if len(tps) > 1:
            raise ValueError("models sharing an instance must use the same tensor parallelism")
        for s in slots:
            if s.weight_bytes >= capacity:
                raise ValueError(f"model {s.name}'s weights do not fit on {hardware.name}")
        self.slots = slots
        self.by_name = {s.name: s for s in slots}
        self.mode: Mode = mode
        self.hardware = hardware
        self.capacity = capacity
        self.switch = switch or SwitchCost()
        self.ttft_slo_s = ttft_slo_s
        self.tpot_slo_s = tpot_slo_s
        # clock seconds per model second: the engine's steps and switches take this many
        # times their modelled duration (``--time-scale``), and ``now``, arrivals and first
        # tokens come from that clock, so every modelled duration compared with them is
        # scaled alike
        self.k = time_scale
        self.stats = SwitchStats()
        self.active: ModelSlot | None = None
        self._hold_until = -math.inf  # token mode keeps a switched-in model until then
        self._load_s = {s.name: self.switch.load_seconds(s.profile, hardware) for s in slots}
        if len(slots) == 1:
            slots[0].resident = True
            self.active = slots[0]
        else:
            self._preload()

    # -- what operators and routers read -----------------------------------------------------
    @property
    def shared(self) -> bool:
        return len(self.slots) > 1

    def resident(self) -> list[str]:
        return [s.name for s in self.slots if s.resident]

    def load_seconds(self, name: str) -> float:
        """What switching ``name`` in costs now (0 when its weights are resident)."""
        s = self.by_name[name]
        return 0.0 if s.resident else self._load_s[name]

    def wait_seconds(self, name: str) -> float:
        """Predicted seconds before ``name`` could run a step: its weights' load and, with
        request-level pooling, the drain of another model's running batch (at most the
        tokens its requests may still ask for, ``max_tokens``)."""
        d = self.load_seconds(name)
        a = self.active
        if self.mode == "request" and a is not None and a.name != name and a.scheduler.running:
            run = a.scheduler.running
            left = max(r.max_tokens - r.num_output_tokens for r in run)
            d += left * a.timing.decode_step_seconds(len(run), 1024)
        return d

    def free_bytes(self) -> float:
        used = 0.0
        for s in self.slots:
            used += s.used_blocks * s.block_bytes
            if s.resident:
                used += s.weight_bytes
        return self.capacity - used

    def has_work(self) -> bool:
        return any(s.has_work() for s in self.slots)

    def kv_usage(self) -> float:
        """Fraction of the memory left by resident weights that requests' KV holds."""
        kv = self.capacity - sum(s.weight_bytes for s in self.slots if s.resident)
        used = sum(s.used_blocks * s.block_bytes for s in self.slots)
        return min(1.0, used / kv) if kv > 0 else 1.0

    # -- the decision --------------------------------------------------------------------
    def next(self, now: float) -> Turn | None:
        """Plan the next step (None: no model has work)."""
        slot = self._choose(now)
        if slot is None:
            return None
        turn = Turn(slot, StepPlan())
        if slot is not self.active or not slot.resident:
            turn.switch_s = self._switch_to(slot, turn.dropped, now)
            if self.switch.prefetched:
                turn.switch_s = 0.0
        else:
            if self.shared and self.free_bytes() < self._kv_floor(slot):
                self._make_room(slot, self._kv_floor(slot), turn.dropped)
            self._cap(slot)
        slot.last_active = now
        turn.plan = slot.scheduler.schedule(now + turn.switch_s * self.k)
        return turn

    def _choose(self, now: float) -> ModelSlot | None:
        if len(self.slots) == 1:
            only = self.slots[0]
            return only if only.has_work() else None
        cands = [s for s in self.slots if s.has_work()]
        if not cands:
            return None
        active = self.active if self.active in cands else None
        if self.mode == "request":
            if active is not None and active.scheduler.running:
                return active
            return min(cands, key=lambda s: (s.oldest_waiting(), s is not active))
        return self._choose_token(now, cands, active)

    def _choose_token(self, now: float, cands: list[ModelSlot],
                      active: ModelSlot | None) -> ModelSlot:
        if active is not None and now < self._hold_until:
            return active  # amortising the switch that brought it in
        deadlines = {s.name: self._deadline(s, now) for s in cands}
        if active is None:
            return min(cands, key=lambda s: deadlines[s.name])
        others = [s for s in cands if s is not active]
        urgent = [s for s in others
                  if deadlines[s.name] - now <= (self.load_seconds(s.name)
                                                 + self.tpot_slo_s) * self.k]
        if urgent:
            best = min(urgent, key=lambda s: deadlines[s.name])
            return best if deadlines[best.name] < deadlines[active.name] else active
        waiting = [s for s in others if s.oldest_waiting() < math.inf]
        if waiting:
            b = min(waiting, key=lambda s: s.oldest_waiting())
            detour = self.load_seconds(b.name) + self._prefill_estimate(b) \
                + self._load_s[active.name] * (not self._stays_resident(active, b))
            slack = min((self._decode_deadline(s) for s in cands), default=math.inf) - now
            if slack >= detour * self.k:
                return b
        return active

    def _deadline(self, s: ModelSlot, now: float) -> float:
        """The model's most urgent deadline: its decodes' next token, or its oldest waiting
        prompt's first token (arrival + TTFT SLO, less its prefill). A prompt that can no
        longer make it (its prefill alone would end past the SLO) is not the most urgent
        work of all, which would have every other model wait behind what misses anyway: it is
        served, best effort, by its late deadline (arrival + SLO + its prefill)."""
        d = self._decode_deadline(s)
        head = min((r for r in s.scheduler.waiting if r.first_token_time is None),
                   key=lambda r: r.arrival_time, default=None)
        if head is not None:
            est = s.timing.prefill_seconds(_to_prefill(head),
                                           s.scheduler.config.max_num_batched_tokens)
            due = head.arrival_time + (self.ttft_slo_s - est) * self.k
            if due < now:
                due = head.arrival_time + (self.ttft_slo_s + est) * self.k
            d = min(d, due)
        return d

    def _decode_deadline(self, s: ModelSlot) -> float:
        """The earliest next-token deadline of the model's started requests."""
        return min((r.first_token_time + r.num_output_tokens * self.tpot_slo_s * self.k
                    for r in s.requests() if r.first_token_time is not None),
                   default=math.inf)

    def _prefill_estimate(self, s: ModelSlot) -> float:
        budget = s.scheduler.config.max_num_batched_tokens
        tokens = sum(_to_prefill(r) for r in s.scheduler.waiting if r.first_token_time is None)
        return s.timing.prefill_seconds(tokens, budget)

    def _stays_resident(self, keep: ModelSlot, incoming: ModelSlot) -> bool:
        """Whether ``keep``'s weights survive bringing ``incoming`` in (a rough check: the
        memory free now plus what idle resident models hold covers the load)."""
        if incoming.resident:
            return True
        spare = self.free_bytes() + sum(s.weight_bytes for s in self.slots
                                        if s.resident and s is not keep and s is not incoming)
        return spare >= incoming.weight_bytes

    # -- switching and memory --------------------------------------------------------------
    def _switch_to(self, slot: ModelSlot, dropped: list[Request], now: float) -> float:
        self.stats.turns += 1
        cost = 0.0
        if not slot.resident:
            self._make_room(slot, slot.weight_bytes + self._kv_floor(slot), dropped)
            slot.resident = True
            cost = self._load_s[slot.name]
            slot.loads += 1
            slot.load_s += cost
            self.stats.switches += 1
            self.stats.switch_s += cost
        elif self.free_bytes() < self._kv_floor(slot):
            self._make_room(slot, self._kv_floor(slot), dropped)
        self._hold_until = now + cost * (1 + QUANTUM) * self.k
        self.active = slot
        for s in self.slots:
            if s is not slot:
                s.pool.reserve(0)
        self._cap(slot)
        return cost

    def _kv_floor(self, slot: ModelSlot) -> float:
        """KV the incoming model needs to make progress: its head request's whole context."""
        head = slot.scheduler.running[0] if slot.scheduler.running else (
            slot.scheduler.waiting[0] if slot.scheduler.waiting else None)
        tokens = head.num_tokens + 1 if head is not None else slot.block_size
        blocks = -(-tokens // slot.block_size)
        return max(0, blocks - slot.used_blocks) * slot.block_bytes

    def _make_room(self, slot: ModelSlot, need: float, dropped: list[Request]) -> None:
        """Free ``need`` bytes: idle models' weights first, then busy ones', then other
        models' KV (their requests preempted), least recently active first."""
        self._drop_weights(slot, need, busy=True)
        others = sorted((s for s in self.slots if s is not slot),
                        key=lambda s: (s.has_work(), s.last_active))
        for s in others:
            if self.free_bytes() >= need:
                return
            s.pool.reserve(0)
            victims = s.scheduler.preempt_all()
            self.stats.kv_drops += len(victims)
            dropped.extend(victims)

    def _drop_weights(self, keep: ModelSlot, need: float, *, busy: bool) -> None:
        """Drop other models' weights, idle ones and then (``busy``) busy ones, least
        recently active first, until ``need`` bytes are free."""
        for s in sorted((s for s in self.slots if s is not keep and s.resident
                         and (busy or not s.has_work())),
                        key=lambda s: (s.has_work(), s.last_active)):
            if self.free_bytes() >= need:
                return
            s.resident = False
            self.stats.weight_evictions += 1

    def _cap(self, slot: ModelSlot) -> None:
        """Let the running model allocate only what the others leave it, after dropping the
        weights of idle models its queued work needs the memory of."""
        if not self.shared:
            return
        bs = slot.block_size
        want = (sum(-(-(r.num_tokens + 1) // bs) for r in slot.requests())
                - slot.used_blocks) * slot.block_bytes
        self._drop_weights(slot, want, busy=False)
        allowed = max(0, int(self.free_bytes() // slot.block_bytes))
        slot.pool.reserve(slot.pool.num_unreferenced - allowed)

    def _preload(self) -> None:
        """Start with as many models resident as fit (in the order given), none running."""
        for s in self.slots:
            if self.free_bytes() - s.weight_bytes >= self._kv_floor(s):
                s.resident = True


def _to_prefill(r: Request) -> int:
    """Prompt tokens ``r`` will compute here: one when its KV comes from a prefill instance
    (the last prompt token is recomputed for the first output token), else its prompt."""
    return 1 if r.remote_prefill is not None else r.num_prompt_tokens
