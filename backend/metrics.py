"""Prometheus metrics under vLLM's names and meanings, so a router written for vLLM reads them.

Gauges (queue sizes, KV usage, cache config) are read from the engine at scrape time; counters
and histograms are updated by the engine's step observer. Everything lives in a registry owned
by one app (no process globals), labelled ``model_name`` and ``engine`` as vLLM does.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from backend.engine import Engine, StepObserver
from backend.model_slot import ModelSlot
from backend.request import Request, Status
from backend.scheduler import StepPlan

_LATENCY = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
            7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
_ITL = (0.001, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
        0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_TOKENS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
_LAG = (0.0001, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.5, 1.0)


class _EngineGauges(Collector):
    def __init__(self, engine: Engine, labels: dict[str, str], role: Callable[[], str]) -> None:
        self._engine = engine
        self._labels = labels
        self._role = role

    def _gauge(self, name: str, doc: str, value: float,
               extra: dict[str, str] | None = None) -> GaugeMetricFamily:
        labels = dict(self._labels, **(extra or {}))
        g = GaugeMetricFamily(name, doc, labels=list(labels))
        g.add_metric(list(labels.values()), value)
        return g

    def collect(self) -> Iterator[Metric]:
        e = self._engine
        mux = e.mux
        usage = e.pool.usage() if not mux.shared else mux.kv_usage()
        for name, doc, value in (
                ("vllm:num_requests_running", "Requests in model execution batches.",
                 lambda s: len(s.scheduler.running)),
                ("vllm:num_requests_waiting", "Requests waiting to be processed.",
                 lambda s: len(s.scheduler.waiting))):
            yield self._per_model(name, doc, value)
        yield self._gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                          usage)
        yield self._gauge("vllm:gpu_cache_usage_perc", "GPU KV-cache usage (older name).", usage)
        yield self._gauge(
            "vllm:cache_config_info", "Information of the LLMEngine CacheConfig.", 1.0,
            {"block_size": str(e.config.block_size), "num_gpu_blocks": str(e.pool.num_blocks),
             "cache_dtype": "auto", "enable_prefix_caching": str(e.config.enable_prefix_caching),
             "gpu_memory_utilization": str(e.config.gpu_memory_utilization)})
        yield self._gauge("tokengate_backend_role_info", "Current prefill/decode role.", 1.0,
                          {"role": self._role()})
        yield self._gauge("tokengate_backend_held_kv_blocks",
                          "Blocks held for decode instances to pull.",
                          sum(len(h.blocks) for h in e.held.values()))
        yield self._gauge("tokengate_backend_busy_seconds",
                          "Modelled GPU-busy time since start (unscaled).", e.lag.busy_s)
        if e.tiers is not None:
            yield from self._tiers(e)
        yield from self._pooling(e)
        if e.config.max_loras:
            yield self._lora(e)

    def _lora(self, e: Engine) -> Metric:
        """vLLM's ``vllm:lora_requests_info``: the adapters with running and waiting requests
        in its labels, the time of the reading as its value."""
        running = sorted({r.lora for s in e.mux.slots for r in s.scheduler.running if r.lora})
        waiting = sorted({r.lora for s in e.mux.slots for r in s.scheduler.waiting if r.lora})
        g = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on lora requests.",
                              labels=["max_lora", "waiting_lora_adapters",
                                      "running_lora_adapters"])
        g.add_metric([str(e.config.max_loras), ",".join(waiting), ",".join(running)],
                     time.time())
        return g

    def _per_model(self, name: str, doc: str, value: Callable[[ModelSlot], float],
                   kind: type[GaugeMetricFamily | CounterMetricFamily] = GaugeMetricFamily,
                   ) -> Metric:
        """One sample per hosted model, labelled with its served name."""
        m = kind(name, doc, labels=list(self._labels))
        rest = [v for k, v in self._labels.items() if k != "model_name"]
        for slot in self._engine.mux.slots:
            name_ = slot.name if self._engine.mux.shared else self._labels["model_name"]
            m.add_metric([name_, *rest], value(slot))
        return m

    def _pooling(self, e: Engine) -> Iterator[Metric]:
        """Which models are resident and what switching costs (several models per instance)."""
        mux = e.mux
        yield self._per_model("tokengate_backend_model_resident",
                              "1 when the model's weights are on the GPU.",
                              lambda s: float(s.resident))
        yield self._per_model("tokengate_backend_model_wait_seconds",
                              "Modelled seconds before the model could run a step: its "
                              "weights' load (0: resident), another model's batch draining.",
                              lambda s: mux.wait_seconds(s.name))
        yield self._per_model("tokengate_backend_model_switches",
                              "Times the model's weights were loaded to switch it in.",
                              lambda s: float(s.loads), CounterMetricFamily)
        yield self._per_model("tokengate_backend_model_switch_seconds",
                              "Modelled seconds spent loading the model's weights.",
                              lambda s: s.load_s, CounterMetricFamily)
        c = CounterMetricFamily("tokengate_backend_kv_dropped_requests",
                                "Requests whose KV was dropped to make room for another model.",
                                labels=list(self._labels))
        c.add_metric(list(self._labels.values()), mux.stats.kv_drops)
        yield c

    def _tiers(self, e: Engine) -> Iterator[Metric]:
        """The lower KV tiers: what a router needs to price a load (capacity, seconds per
        token, latency) and what they did (vLLM's external prefix-cache counters, ours)."""
        t = e.tiers
        walk = e.scheduler.tiers
        assert t is not None and walk is not None
        bs = e.config.block_size
        names = [*self._labels, "medium"]
        info = GaugeMetricFamily("tokengate_backend_kv_tier_info",
                                 "A lower KV tier: capacity and load cost.",
                                 labels=[*names, "capacity_blocks", "seconds_per_token",
                                         "latency_seconds", "block_bytes"])
        held = GaugeMetricFamily("tokengate_backend_kv_tier_blocks", "Blocks a tier holds.",
                                 labels=names)
        lv = list(self._labels.values())
        if t.host is not None:
            info.add_metric([*lv, "CPU", str(t.host.capacity),
                             repr(t.cost.host_seconds_per_token()), "0",
                             str(t.bytes_per_block)], 1.0)
            held.add_metric([*lv, "CPU"], len(t.host))
        if t.pool_url is not None:
            info.add_metric([*lv, "POOL", "0", repr(t.cost.pool_seconds_per_token()),
                             repr(t.cost.link_latency_s), str(t.bytes_per_block)], 1.0)
        yield info
        yield held
        hits = sum(s.hit_tokens for s in t.stats.values())
        for name, doc, v in (
                ("vllm:external_prefix_cache_queries",
                 "External prefix cache queries (host memory, pool), in tokens.",
                 walk.queried_blocks * bs),
                ("vllm:external_prefix_cache_hits",
                 "External prefix cache hits (host memory, pool), in tokens.", hits)):
            c = CounterMetricFamily(name, doc, labels=list(self._labels))
            c.add_metric(lv, v)
            yield c
        for name, doc, attr in (
                ("hit_tokens", "Prompt tokens loaded from a tier instead of computed.",
                 "hit_tokens"),
                ("loaded_bytes", "KV bytes loaded from a tier.", "loaded_bytes"),
                ("loads", "Loads from a tier.", "loads"),
                ("stored_blocks", "Blocks a tier stored.", "stored_blocks"),
                ("evicted_blocks", "Blocks a tier evicted.", "evicted_blocks")):
            c = CounterMetricFamily(f"tokengate_backend_kv_tier_{name}", doc, labels=names)
            for medium, st in t.stats.items():
                c.add_metric([*lv, medium], getattr(st, attr))
            yield c


RECENT = 4096  # finished requests whose times ``/admin/requests`` keeps


class BackendMetrics:
    """The registry of one backend instance and the observer that feeds it."""

    def __init__(self, engine: Engine, model_name: str, role: Callable[[], str]) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        labels = {"model_name": model_name, "engine": "0"}
        names = list(labels)
        r = self.registry
        self._labels = labels

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc, [*names, *extra], registry=r)

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, names, buckets=buckets, registry=r)

        lv = list(labels.values())
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prefill tokens processed.").labels(*lv)
        self.generation_tokens = counter("vllm:generation_tokens",
                                         "Generation tokens processed.").labels(*lv)
        self.preemptions = counter("vllm:num_preemptions",
                                   "Cumulative number of preemptions.").labels(*lv)
        self.prefix_queries = counter("vllm:prefix_cache_queries",
                                      "Prefix cache queries, in tokens.").labels(*lv)
        self.prefix_hits = counter("vllm:prefix_cache_hits",
                                   "Prefix cache hits, in tokens.").labels(*lv)
        self._success = counter("vllm:request_success", "Successfully processed requests.",
                                ("finished_reason",))
        self.ttft = hist("vllm:time_to_first_token_seconds", "Time to first token.", _LATENCY
                         ).labels(*lv)
        self.itl = hist("vllm:inter_token_latency_seconds", "Inter-token latency.", _ITL
                        ).labels(*lv)
        self.e2e = hist("vllm:e2e_request_latency_seconds", "End-to-end request latency.",
                        _LATENCY).labels(*lv)
        self.queue = hist("vllm:request_queue_time_seconds", "Time spent waiting.", _LATENCY
                          ).labels(*lv)
        self.prefill = hist("vllm:request_prefill_time_seconds", "Time spent in prefill.",
                            _LATENCY).labels(*lv)
        self.decode = hist("vllm:request_decode_time_seconds", "Time spent in decode.",
                           _LATENCY).labels(*lv)
        self.req_prompt = hist("vllm:request_prompt_tokens", "Prompt tokens per request.",
                               _TOKENS).labels(*lv)
        self.req_gen = hist("vllm:request_generation_tokens", "Generation tokens per request.",
                            _TOKENS).labels(*lv)
        self.iteration = hist("vllm:iteration_tokens_total", "Tokens per engine step.",
                              _TOKENS).labels(*lv)
        self.lag = hist("tokengate_backend_loop_lag_seconds",
                        "How late the engine loop woke up after a modelled step.", _LAG
                        ).labels(*lv)
        self.kv_transfer = hist("tokengate_backend_kv_transfer_seconds",
                                "Time to pull a prompt's KV from a prefill instance.", _LATENCY
                                ).labels(*lv)
        self.kv_transfer_tokens = counter("tokengate_backend_kv_transfer_tokens",
                                          "Prompt tokens whose KV was pulled.").labels(*lv)
        self.kv_transfer_failures = counter("tokengate_backend_kv_transfer_failures",
                                            "KV pulls that failed (prompt recomputed).").labels(*lv)
        r.register(_EngineGauges(engine, labels, role))
        self._engine = engine
        # the latest finished requests' times on the engine's clock (``/admin/requests``)
        self.recent: deque[tuple[str, float, float | None, float | None, float]] = deque(
            maxlen=RECENT)
        self._last_queries = 0
        self._last_hits = 0

    def observer(self) -> StepObserver:
        return StepObserver(on_step=self._on_step, on_token=self._on_token,
                            on_finish=self._on_finish, on_preempt=self._on_preempt)

    def _on_step(self, plan: StepPlan, duration: float, lag: float) -> None:
        self.iteration.observe(plan.num_tokens)
        self.lag.observe(lag)
        prefill = sum(n for r, n, ctx in plan.scheduled if ctx < r.num_prompt_tokens)
        if prefill:
            self.prompt_tokens.inc(prefill)
        stats = self._engine.kv.stats
        if stats.queries != self._last_queries:
            self.prefix_queries.inc(stats.queries - self._last_queries)
            self.prefix_hits.inc(stats.hits - self._last_hits)
            self._last_queries, self._last_hits = stats.queries, stats.hits

    def _on_token(self, req: Request, now: float) -> None:
        self.generation_tokens.inc()
        if req.num_output_tokens == 1:
            self.ttft.observe(now - req.arrival_time)
        elif req.last_token_time is not None:
            self.itl.observe(now - req.last_token_time)

    def _on_finish(self, req: Request, now: float) -> None:
        if req.status is Status.FINISHED_ABORTED:
            return
        self.recent.append((req.request_id, req.arrival_time, req.first_scheduled_time,
                            req.first_token_time, now))
        reason = "stop" if req.status is Status.FINISHED_STOPPED else "length"
        self._success.labels(*self._labels.values(), reason).inc()
        self.e2e.observe(now - req.arrival_time)
        self.req_prompt.observe(req.num_prompt_tokens)
        self.req_gen.observe(req.num_output_tokens)
        if req.first_scheduled_time is not None:
            self.queue.observe(req.first_scheduled_time - req.arrival_time)
            if req.first_token_time is not None:
                self.prefill.observe(req.first_token_time - req.first_scheduled_time)
                self.decode.observe(now - req.first_token_time)

    def _on_preempt(self, req: Request) -> None:
        self.preemptions.inc()
