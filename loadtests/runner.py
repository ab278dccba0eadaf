"""The load runner: open-loop arrivals (or explicit closed-loop concurrency), bounded in time.

Open loop: each request is sent at its scheduled offset, whatever happened to earlier ones, so
a slow server sees its queue grow as it would in production. Closed loop (``concurrency``):
that many workers each send the next request when their previous one ends. Sessions: a task
per conversation sends turn k+1 a think time after turn k's answer.

Every request has a timeout; the run stops issuing at ``duration_s`` and cancels what is still
in flight ``grace_s`` later (counted as ``cancelled``). The runner also measures its own event
loop's lag (a 10 ms timer), which bounds how much client CPU could skew its timestamps.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from loadtests.client import RequestResult, stream_request
from loadtests.workloads import Endpoint, Planned, Session, request_body


@dataclass(slots=True)
class Target:
    label: str
    base_url: str
    api_key: str | None = None
    model: str | None = None
    # More base URLs of the same service (gateway replicas): requests alternate over
    # base_url and these in turn, as a round-robin load balancer in front would.
    mirrors: tuple[str, ...] = ()
    _turn: int = 0

    def url(self, endpoint: Endpoint) -> str:
        path = "chat/completions" if endpoint == "chat" else "completions"
        base = self.base_url
        if self.mirrors:
            self._turn += 1
            i = self._turn % (len(self.mirrors) + 1)
            base = self.mirrors[i - 1] if i else self.base_url
        return f"{base.rstrip('/')}/{path}"

    def headers(self) -> dict[str, str]:
        h = {"Content-Type": "application/json"}
        if self.api_key:
            h["Authorization"] = f"Bearer {self.api_key}"
        return h


@dataclass(slots=True)
class RunSettings:
    endpoint: Endpoint = "completions"
    duration_s: float | None = None
    grace_s: float = 30.0
    timeout_s: float = 600.0
    concurrency: int | None = None  # closed loop when set
    max_requests: int | None = None  # sessions: cap on turns sent


@dataclass(slots=True)
class RunOutput:
    results: list[RequestResult]
    duration_s: float
    loop_lag_ms: dict[str, float]
    started_at: float  # perf_counter at the run's start (results' times are relative to it)


@dataclass(slots=True)
class Progress:
    """Live counters the progress display reads."""

    sent: int = 0
    done: int = 0
    failed: int = 0
    ttfts: list[float] = field(default_factory=list)

    def record(self, r: RequestResult) -> None:
        self.done += 1
        if r.ok:
            if r.ttft is not None:
                self.ttfts.append(r.ttft)
        else:
            self.failed += 1

    def ttft_p50_ms(self) -> float | None:
        if not self.ttfts:
            return None
        recent = sorted(self.ttfts[-500:])
        return recent[len(recent) // 2] * 1e3


class LoopLag:
    """How late this process's event loop runs a 10 ms timer: the skew client CPU could put
    on the timestamps it takes."""

    def __init__(self) -> None:
        self.samples: list[float] = []
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.ensure_future(self.run())

    def stop(self) -> dict[str, float]:
        if self._task is not None:
            self._task.cancel()
        return self.summary()

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            t = loop.time()
            await asyncio.sleep(0.01)
            self.samples.append(max(0.0, loop.time() - t - 0.01))

    def summary(self) -> dict[str, float]:
        s = sorted(self.samples) or [0.0]
        return {"p50": s[len(s) // 2] * 1e3, "p99": s[min(len(s) - 1, int(len(s) * 0.99))] * 1e3,
                "max": s[-1] * 1e3, "samples": float(len(self.samples))}


async def resolve_model(session: aiohttp.ClientSession, target: Target) -> str:
    if target.model:
        return target.model
    async with session.get(f"{target.base_url.rstrip('/')}/models",
                           headers=target.headers()) as r:
        data = await r.json()
    return str(data["data"][0]["id"])


async def run(target: Target, work: Sequence[Planned | Session], settings: RunSettings,
              count_tokens: Callable[[str], int], progress: Progress | None = None,
              on_tick: Callable[[Progress], None] | None = None) -> RunOutput:
    """Send ``work`` to ``target`` and collect one result per request sent.

    Output tokens come from the server's ``usage``; where a server sends none they are counted
    by re-tokenizing the streamed text with ``count_tokens``.
    """
    progress = progress or Progress()
    lag = LoopLag()
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    results: list[RequestResult] = []
    async with aiohttp.ClientSession(connector=connector) as http:
        model = await resolve_model(http, target)
        headers = target.headers()

        async def send(prompt: Any, max_tokens: int) -> RequestResult:
            progress.sent += 1
            body = request_body(model, settings.endpoint, prompt, max_tokens)
            url = target.url(settings.endpoint)  # per request: mirrors alternate
            r = await stream_request(http, url, body, headers=headers,
                                     timeout_s=settings.timeout_s)
            if r.ok and not r.usage_reported:
                r.output_tokens = count_tokens(r.text)
            results.append(r)
            progress.record(r)
            if on_tick:
                on_tick(progress)
            return r

        lag.start()
        start = time.perf_counter()
        deadline = start + settings.duration_s if settings.duration_s else None
        tasks: list[asyncio.Task[Any]] = []
        try:
            planned = [w for w in work if isinstance(w, Planned)]
            convs = [w for w in work if isinstance(w, Session)]
            if convs:
                tasks = await _sessions(convs, send, settings, start, deadline)
            elif settings.concurrency:
                tasks = _closed_loop(planned, send, settings.concurrency, deadline)
            else:
                tasks = await _open_loop(planned, send, start, deadline)
            if tasks:
                limit = (deadline - time.perf_counter() + settings.grace_s) if deadline else None
                _, pending = await asyncio.wait(tasks, timeout=limit)
                for t in pending:
                    t.cancel()
                if pending:
                    await asyncio.wait(pending)
        finally:
            lag.stop()
        duration = time.perf_counter() - start
    cancelled = progress.sent - len(results)
    for _ in range(cancelled):
        r = RequestResult(sent_at=start + duration, error="cancelled")
        results.append(r)
        progress.record(r)
    return RunOutput(results, duration, lag.summary(), start)


async def _at(offsets: Sequence[float], start: float, deadline: float | None,
              spawn: Callable[[int], Coroutine[Any, Any, Any]]) -> list[asyncio.Task[Any]]:
    """Start ``spawn(i)`` at ``start + offsets[i]``, never waiting for earlier ones."""
    tasks = []
    for i, offset in enumerate(offsets):
        at = start + offset
        if deadline is not None and at > deadline:
            break
        delay = at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.ensure_future(spawn(i)))
    return tasks


async def _open_loop(work: list[Planned], send: Any, start: float,
                     deadline: float | None) -> list[asyncio.Task[Any]]:
    return await _at([p.t for p in work], start, deadline,
                     lambda i: send(work[i].prompt, work[i].output_tokens))


def _closed_loop(work: list[Planned], send: Any, concurrency: int,
                 deadline: float | None) -> list[asyncio.Task[Any]]:
    queue = list(reversed(work))

    async def worker() -> None:
        while queue and (deadline is None or time.perf_counter() < deadline):
            p = queue.pop()
            await send(p.prompt, p.output_tokens)

    return [asyncio.ensure_future(worker()) for _ in range(concurrency)]


async def _sessions(work: list[Session], send: Any, settings: RunSettings, start: float,
                    deadline: float | None) -> list[asyncio.Task[Any]]:
    budget = [settings.max_requests if settings.max_requests is not None else 1 << 62]

    async def conversation(s: Session) -> None:
        rng = random.Random(s.index)
        answer: str | None = None
        for turn, out in enumerate(s.outputs):
            if budget[0] <= 0 or (deadline is not None and time.perf_counter() > deadline):
                return
            budget[0] -= 1
            r = await send(list(s.next_messages(turn, answer)), out)
            if not r.ok:
                return
            answer = r.text
            if s.think_time_s > 0:
                await asyncio.sleep(rng.expovariate(1.0 / s.think_time_s))

    return await _at([s.start for s in work], start, deadline,
                     lambda i: conversation(work[i]))
