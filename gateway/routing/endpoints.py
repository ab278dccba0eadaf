"""Endpoints and pools: live counters, scraped engine state, circuit breaking.

An ``EndpointState`` is one upstream base URL, shared by every pool and policy version that
names it (``Fleet`` in ``gateway.routing.fleet`` owns them), so its live counters survive
policy reloads. It carries two kinds of state:

* the gateway's own live counters, exact at every decision: requests in flight, uncached
  prompt tokens sent and not yet answered (``prefill_tokens``), sequences past their first
  token (``decoding``), tokens reserved (prompt + expected output) outstanding;
* the engine's own view, scraped from its vLLM metrics every ~200 ms: queue, batch, KV usage,
  block size and KV capacity.

Health: an endpoint that failed ``trip_after`` times in a row (connect errors, 5xx before the
first byte, broken streams, failed scrapes) is skipped for ``cooldown_s``; one success resets
it. When every endpoint is cooling down the pool still offers them (failing open beats refusing
all traffic).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from gateway import clock as clk
from gateway.config.policy import Model
from gateway.config.resilience import Retries
from gateway.routing.retry import RetryBudget
from predictor.features import DEFAULT_PREFILL_RATE  # tokens/ms before any observation


@dataclass(slots=True, eq=False)
class LiveLoad:
    """The gateway's own live view of the load it put on an endpoint, exact at every decision.
    Written by the request path only: ``EndpointPool``'s tickets (sent, first token,
    released), the relay's token tally (``streamed``) and ``observed`` when a stream ends."""

    in_flight: int = 0
    tokens_outstanding: int = 0
    prefill_tokens: int = 0
    decoding: int = 0
    routed: int = 0
    # ticket -> (sent, prefill tokens) of requests awaiting their first token, in send order
    pending: dict[int, tuple[float, int]] = field(default_factory=dict)
    # requests the other gateway replicas sent here awaiting their first token, as of their
    # last fair-share exchange (``gateway.flow.share``): 0 with one replica
    pending_elsewhere: int = 0
    prefill_rate: float = 0.0  # tokens/ms computed, from head-of-queue prefills observed
    rate_tokens: float = 0.0  # their tokens and spans, decayed sums (the rate is the ratio)
    rate_ms: float = 0.0
    arrivals: float = 0.0  # uncached tokens sent here, exponentially decayed (tau ARRIVAL_TAU_S)
    arrivals_at: float = 0.0
    recent_ttft_ms: float = 0.0  # EWMA of TTFT / TPOT of the streams it recently served
    recent_tpot_ms: float = 0.0
    head_done_at: float = 0.0  # when the last head-of-queue request got its first token
    # the current decode step: tokens relayed from here, against sequence-seconds decoding
    streamed: int = 0  # content tokens relayed from this endpoint (the relay counts them)
    seq_s: float = 0.0  # integral of ``decoding`` over time, seconds
    seq_at: float = 0.0
    step_mark: tuple[float, int, float] = (0.0, 0, 0.0)  # (when, streamed, seq_s)
    step_seq_s: float = 0.0  # decayed sums of sequence-seconds and tokens
    step_tokens: float = 0.0
    step_ms: float = 0.0  # per-sequence time between tokens here, lately (0 before any)
    # called when a request here starts or ends (flow control lets the next one through)
    watchers: list[Callable[[], None]] = field(default_factory=list)

    def oldest_pending_ms(self, now: float) -> float:
        """How long the oldest request still waiting for its first token has waited."""
        for sent, _ in self.pending.values():
            return max(now - sent, 0.0) * 1000.0
        return 0.0

    def prefill_queue_ms(self, now: float) -> float:
        """Estimated prefill work ahead of a new request, in ms: the uncached tokens awaiting
        their first token, less what the queue's head has likely computed since it started
        (at the observed prefill rate), over that rate. A virtual queue: exact counters,
        one learned rate."""
        if not self.pending:
            return 0.0
        rate = self.prefill_rate or DEFAULT_PREFILL_RATE
        sent, tokens = next(iter(self.pending.values()))
        done = min(float(tokens), rate * max(now - max(sent, self.head_done_at), 0.0) * 1e3)
        return max(self.prefill_tokens - done, 0.0) / rate

    def prefill_finish_ms(self, now: float, uncached_tokens: int) -> float:
        """When a new prompt of ``uncached_tokens`` sent here now would be computed, in ms:
        the virtual queue ahead of it, then its own tokens, at the observed prefill rate."""
        rate = self.prefill_rate or DEFAULT_PREFILL_RATE
        return self.prefill_queue_ms(now) + uncached_tokens / rate

    def arrival_rate(self, now: float) -> float:
        """Uncached prompt tokens sent here per second, recently (exponentially weighted over
        ``ARRIVAL_TAU_S``): the prefill work that will share the steps of a request decoding
        here, which is what its TPOT depends on."""
        return self.arrivals * math.exp(-(now - self.arrivals_at) / ARRIVAL_TAU_S) / ARRIVAL_TAU_S

    def add_arrival(self, tokens: int, now: float) -> None:
        self.arrivals = self.arrivals * math.exp(-(now - self.arrivals_at) / ARRIVAL_TAU_S) + tokens
        self.arrivals_at = now

    def observed(self, ttft_ms: float | None, tpot_ms: float | None) -> None:
        """A stream served here finished: fold what it saw into the recent averages.

        NOTE: consecutive requests on one endpoint have strongly correlated TPOT (lag-1 ~0.8
        under steady load), but because they share the same future steps, not because the
        past predicts them: a stream's TPOT is known only when it ends, and these averages
        barely moved the predictor's error in the measurement (TPOT MAPE 0.42 -> 0.39)."""
        if ttft_ms is not None:
            self.recent_ttft_ms = ttft_ms if not self.recent_ttft_ms else (
                (1 - RECENT_ALPHA) * self.recent_ttft_ms + RECENT_ALPHA * ttft_ms)
        if tpot_ms is not None:
            self.recent_tpot_ms = tpot_ms if not self.recent_tpot_ms else (
                (1 - RECENT_ALPHA) * self.recent_tpot_ms + RECENT_ALPHA * tpot_ms)

    def integrate(self, now: float) -> None:
        """Bring the sequence-seconds integral up to ``now`` (before ``decoding`` changes)."""
        self.seq_s += self.decoding * max(now - self.seq_at, 0.0)
        self.seq_at = now

    def current_step_ms(self, now: float) -> float:
        """How long a sequence decoding here currently waits between tokens, in ms: the
        sequence-seconds this gateway's streams spent decoding here over the tokens they
        received, both exponentially decayed (time constant ``STEP_TAU_S``, updated at most
        every ``STEP_WINDOW_S``) so the estimate is a ratio of sums, not a mean of per-window
        ratios (which windows holding one long prefill-chunk step would bias upwards). It is
        the endpoint's decode step as the gateway sees it (batch size and prefill chunks
        sharing the steps included): the freshest view of the TPOT a new stream will get,
        known at every decision instead of when streams end."""
        self.integrate(now)
        at, streamed, seq = self.step_mark
        if now - at >= STEP_WINDOW_S:
            keep = math.exp(-(now - at) / STEP_TAU_S)
            self.step_seq_s = self.step_seq_s * keep + (self.seq_s - seq)
            self.step_tokens = self.step_tokens * keep + (self.streamed - streamed)
            self.step_mark = (now, self.streamed, self.seq_s)
            if self.step_tokens >= STEP_MIN_TOKENS:
                self.step_ms = self.step_seq_s * 1e3 / self.step_tokens
        return self.step_ms

    def prefill_done(self, key: int, tokens: int, now: float) -> None:
        """A request got its first token; if it headed the queue, learn the prefill rate."""
        entry = self.pending.pop(key, None)
        if entry is None:
            return
        if not self.pending or next(iter(self.pending)) > key:  # it was the head
            span_ms = max((now - max(entry[0], self.head_done_at)) * 1e3, 0.0)
            if tokens >= RATE_MIN_TOKENS:
                # NOTE: a ratio of decayed sums, not an average of per-request rates: a
                # request whose prefill ends in the same step as the one before it has a
                # span of ~0 ms, and its own rate sample would be absurd (the average was
                # off by 4x under load); its tokens still count against the time they took.
                self.rate_tokens = self.rate_tokens * (1 - RATE_ALPHA) + tokens
                self.rate_ms = self.rate_ms * (1 - RATE_ALPHA) + span_ms
                if self.rate_ms > 0:
                    self.prefill_rate = self.rate_tokens / self.rate_ms
            self.head_done_at = now


def base_url(url: str) -> str:
    """``http://host:port/v1`` → ``http://host:port`` (where /metrics and /health live)."""
    return url[:-3] if url.endswith("/v1") else url


@dataclass(slots=True, eq=False)
class EngineView:
    """The engine's own view of itself, scraped from its metrics every ~200 ms. Written by
    ``Fleet``'s scrape only."""

    kv_usage: float = 0.0
    running: float = 0.0
    waiting: float = 0.0
    block_size: int | None = None
    num_gpu_blocks: int | None = None
    # cache_config_info's enable_prefix_caching (None: not said): False for an engine that
    # keeps no prefix cache (vLLM: pooling models with bidirectional attention or mean/CLS
    # pooling, or --no-enable-prefix-caching), where prefix affinity has nothing to find
    prefix_caching: bool | None = None
    prefix_queries: float = 0.0
    prefix_hits: float = 0.0
    prompt_tokens_cached: float = 0.0
    external_prefix_queries: float = 0.0  # a KV connector's tier (LMCache, NIXL…)
    external_prefix_hits: float = 0.0
    # lower KV tiers the engine reports (the reference backend's tokengate_backend_kv_tier_info)
    host_blocks: int | None = None  # host-memory offload capacity, blocks
    host_s_per_token: float = 0.0  # load time from host memory, seconds per token
    pool_s_per_token: float | None = None  # set: the engine fetches from a shared pool
    pool_latency_s: float = 0.0
    block_bytes: int = 0  # KV bytes of one block (sizes the pool's approximate index)
    preemptions: float = 0.0
    waiting_by_reason: dict[str, float] = field(default_factory=dict)
    max_model_len: int | None = None  # from /v1/models (vLLM and the reference backend say)
    # several models on one engine (tokengate backend --models): seconds each waits before
    # it could run (its switch; 0 when resident), and which are resident
    model_wait_s: dict[str, float] = field(default_factory=dict)
    resident: frozenset[str] = frozenset()
    started_at: float | None = None  # process_start_time_seconds: a change is a restart
    models_read_at: float = -math.inf  # when /v1/models was last asked (every 30 s at most)
    scraped_at: float = 0.0


@dataclass(slots=True, eq=False)
class Health:
    """Whether an endpoint is in rotation: its circuit breaker, a pause it asked for, a
    drain, and its outcome counts. Written by ``EndpointPool`` (outcomes), ``Fleet``'s probes
    and the drains (admin, scale-in)."""

    consecutive_failures: int = 0
    down_until: float = 0.0
    backoff_until: float = 0.0  # it asked for a pause (retry-after on 429/503)
    draining: bool = False  # taken out of rotation (POST /admin/drain, scale-in)
    answer_failures: int = 0  # of the consecutive failures, those that were 5xx answers
    served: int = 0
    failed: int = 0
    # called when the endpoint trips (requests waiting on it for their first token)
    on_trip: set[Callable[[], None]] = field(default_factory=set)

    def healthy(self, now: float) -> bool:
        return now >= self.down_until and now >= self.backoff_until

    def trip(self, until: float) -> None:
        """Out of rotation until ``until`` (monotonic); whoever waits on it is told."""
        self.down_until = max(self.down_until, until)
        for told in list(self.on_trip):
            told()

    def count_failure(self, now: float, trip_after: int, cooldown_s: float, *,
                      transport: bool = True) -> None:
        """One more failure in a row; ``trip_after`` of them take the endpoint out for
        ``cooldown_s``. Transport failures (refused or broken connections, failed scrapes)
        end with the next successful scrape; answer failures (5xx) only with a successful
        request: after the cooldown one request is let through (half-open), and if it fails
        too the count is still past ``trip_after`` and the endpoint trips again at once."""
        self.consecutive_failures += 1
        if not transport:
            self.answer_failures += 1
        if self.consecutive_failures >= trip_after:
            self.trip(now + cooldown_s)

    def reset_health(self) -> None:
        self.consecutive_failures = 0
        self.answer_failures = 0
        self.down_until = 0.0


@dataclass(slots=True, eq=False)
class EndpointState:
    """One upstream base URL: its identity, and three parts with one writer each."""

    url: str
    api_key: str | None = None
    role: str = "both"
    hardware: str | None = None
    ca_file: str | None = None  # the CA bundle that verifies an https endpoint
    live: LiveLoad = field(default_factory=LiveLoad)
    engine: EngineView = field(default_factory=EngineView)
    health: Health = field(default_factory=Health)

    def healthy(self, now: float) -> bool:
        return self.health.healthy(now)


RATE_MIN_TOKENS = 512  # shorter prefills are dominated by step granularity
RATE_ALPHA = 0.2
ARRIVAL_TAU_S = 5.0
RECENT_ALPHA = 0.3
STEP_WINDOW_S = 0.2
STEP_MIN_TOKENS = 8
STEP_TAU_S = 2.0
MAX_RETRY_AFTER_S = 30.0


_tickets = itertools.count(1)


@dataclass(slots=True, eq=False)
class Ticket:
    """One request's share of an endpoint's live counters, given back exactly once."""

    ep: EndpointState
    tokens: int
    prefill_tokens: int
    key: int
    decoding: bool = False
    released: bool = False


class EndpointPool:
    """One model's endpoints and their health bookkeeping."""

    def __init__(self, model: Model, endpoints: Sequence[EndpointState], *,
                 trip_after: int = 3, cooldown_s: float = 5.0,
                 clock: Callable[[], float] | None = None,
                 retries: Retries | None = None,
                 api_keys: dict[str, str | None] | None = None) -> None:
        self.model = model
        self.endpoints = list(endpoints)
        self.trip_after = trip_after
        self.cooldown_s = cooldown_s
        self._clock = clock or clk.now
        r = retries or Retries()
        self.budget = RetryBudget(r.budget_ratio, r.min_per_s, clock=self._clock)
        # This model's credential per endpoint URL: two models may share an endpoint with
        # different keys, so requests use the pool's key, not the shared EndpointState's.
        self.api_keys: dict[str, str | None] = (
            api_keys if api_keys is not None else {e.url: e.api_key for e in self.endpoints})

    def auth_headers(self, e: EndpointState) -> dict[str, str]:
        key = self.api_keys.get(e.url)
        return {"Authorization": f"Bearer {key}"} if key else {}

    @property
    def disaggregated(self) -> bool:
        return any(e.role != "both" for e in self.endpoints)

    def candidates(self, exclude: Sequence[EndpointState] = (),
                   roles: tuple[str, ...] = ("both", "prefill", "decode")
                   ) -> list[EndpointState]:
        left = self._left(exclude, roles)
        now = self._clock()
        healthy = [e for e in left if e.healthy(now)]
        return healthy or left

    def _left(self, exclude: Sequence[EndpointState], roles: tuple[str, ...]
              ) -> list[EndpointState]:
        """The endpoints of ``roles`` not excluded and not draining, healthy or not."""
        return [e for e in self.endpoints
                if e not in exclude and e.role in roles and not e.health.draining]

    def elsewhere(self, e: EndpointState) -> bool:
        """Whether another endpoint that could take ``e``'s requests is in rotation now: a
        request taken off ``e`` would have somewhere to go."""
        now = self._clock()
        return any(o.healthy(now) for o in self._left((e,), (e.role, "both")))

    @staticmethod
    def acquire(e: EndpointState, tokens: int, prefill_tokens: int) -> Ticket:
        """A request is sent to ``e``: ``tokens`` reserved, ``prefill_tokens`` to compute."""
        t = Ticket(e, tokens, prefill_tokens, next(_tickets))
        e.live.in_flight += 1
        e.live.routed += 1
        e.live.tokens_outstanding += tokens
        e.live.prefill_tokens += prefill_tokens
        now = clk.now()
        e.live.pending[t.key] = (now, prefill_tokens)
        e.live.add_arrival(prefill_tokens, now)
        return t

    @staticmethod
    def first_token(t: Ticket) -> None:
        """The request's first token arrived: its prompt is computed, it now decodes."""
        if t.decoding or t.released:
            return
        t.decoding = True
        e = t.ep
        now = clk.now()
        e.live.integrate(now)
        e.live.prefill_tokens -= t.prefill_tokens
        e.live.decoding += 1
        e.live.prefill_done(t.key, t.prefill_tokens, now)
        for w in e.live.watchers:
            w()

    @staticmethod
    def release(t: Ticket) -> None:
        if t.released:
            return
        t.released = True
        e = t.ep
        e.live.in_flight -= 1
        e.live.tokens_outstanding -= t.tokens
        if t.decoding:
            e.live.integrate(clk.now())
            e.live.decoding -= 1
        else:
            e.live.prefill_tokens -= t.prefill_tokens
            e.live.pending.pop(t.key, None)
            for w in e.live.watchers:
                w()

    def succeeded(self, e: EndpointState) -> None:
        e.health.reset_health()
        e.health.served += 1

    def failed(self, e: EndpointState, *, transport: bool = False) -> None:
        e.health.failed += 1
        e.health.count_failure(self._clock(), self.trip_after, self.cooldown_s, transport=transport)

    def overloaded(self, e: EndpointState, retry_after: str) -> None:
        """The endpoint answered 429/503 with ``retry-after``: leave it alone that long (up
        to ``MAX_RETRY_AFTER_S``), as it asked, instead of probing it with more requests."""
        try:
            pause = min(float(retry_after), MAX_RETRY_AFTER_S)
        except ValueError:
            return
        if pause > 0:
            e.health.backoff_until = max(e.health.backoff_until, self._clock() + pause)
