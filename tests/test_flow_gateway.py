"""Flow control through the gateway, in real time on a reference backend that runs at most four
sequences at once: a flooding tenant's queue is held in the gateway, not in the engine, so a
light tenant's request goes next under ``fair`` (and waits behind the flood under ``fcfs``);
a full queue sheds with a 429 in OpenAI's shape; ``x-fairness-id`` is validated."""

from __future__ import annotations

import asyncio
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from aiohttp import web
from conftest import RunningBackend
from gateway_stack import RunningGateway, start_gateway, write_policy
from test_gateway_e2e import sha
from threaded import start_server_thread

from loadtests.echo_upstream import build
from protocol.loopback import free_port

Factory = Callable[..., RunningBackend]
FLOOD = "lorem ipsum dolor sit amet " * 60


def policy(url: str, mode: str, **flow: Any) -> dict[str, Any]:
    return {"version": 1,
            "settings": {"flow_control": {"mode": mode, "queue_depth": 1, **flow}},
            "models": {"m": {"endpoints": [{"url": url}], "default_max_tokens": 16,
                             "upstream_model": "llama-3-8b"}},
            "tenants": {"flood": {"keys": [{"sha256": sha("key-flood")}]},
                        "light": {"keys": [{"sha256": sha("key-light")}]}},
            "routes": {"r": {"tenants": ["flood", "light"], "models": ["m"]}}}


@pytest.fixture
def engine(backend_factory: Factory) -> RunningBackend:
    return backend_factory(time_scale=0.5, max_num_seqs=4)


def flood(gw: RunningGateway, stop: threading.Event, clients: int) -> ThreadPoolExecutor:
    c = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="key-flood", max_retries=0,
                      timeout=120)

    def loop() -> None:
        while not stop.is_set():
            c.completions.create(model="m", prompt=FLOOD, max_tokens=24)

    pool = ThreadPoolExecutor(clients)
    for _ in range(clients):
        pool.submit(loop)
    return pool


def victim_ttfts(gw: RunningGateway, n: int) -> list[float]:
    c = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="key-light", max_retries=0,
                      timeout=120)
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        stream = c.completions.create(model="m", prompt="hello", max_tokens=4, stream=True)
        for _chunk in stream:
            out.append(time.perf_counter() - t0)
            break
        stream.close()
        time.sleep(0.05)
    return out


@pytest.fixture
def gateways(tmp_path: Path) -> Iterator[Callable[[dict[str, Any]], RunningGateway]]:
    made: list[RunningGateway] = []

    def make(doc: dict[str, Any]) -> RunningGateway:
        gw = start_gateway(write_policy(tmp_path / f"policy-{len(made)}.yaml", doc))
        made.append(gw)
        return gw

    yield make
    for gw in made:
        gw.close()


def test_a_light_tenant_goes_ahead_of_a_flood_under_fair_not_under_fcfs(
        engine: RunningBackend, gateways: Callable[[dict[str, Any]], RunningGateway]) -> None:
    medians = {}
    for mode in ("fcfs", "fair"):
        gw = gateways(policy(f"{engine.url}/v1", mode))
        stop = threading.Event()
        pool = flood(gw, stop, 20)
        try:
            time.sleep(1.0)  # the flood fills the engine (fcfs) or the gateway's queue (fair)
            medians[mode] = statistics.median(victim_ttfts(gw, 8))
        finally:
            stop.set()
            pool.shutdown(wait=True)
        if mode == "fair":
            text = httpx.get(f"{gw.url}/metrics").text
            assert 'tokengate_flow_wait_seconds_count{model="m",priority="standard"}' in text
            served = {t: gw.state.flow.gates["m"].gate.queue.counters.get(t, 0.0)
                      for t in ("flood", "light")}
            assert served["flood"] > served["light"] > 0, served
    print("victim TTFT medians", medians)
    assert medians["fair"] < 0.5 * medians["fcfs"], medians


def test_a_full_queue_sheds_in_openais_shape(
        engine: RunningBackend, gateways: Callable[[dict[str, Any]], RunningGateway]) -> None:
    gw = gateways(policy(f"{engine.url}/v1", "fair", max_queued=2))
    c = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="key-flood", max_retries=0,
                      timeout=120)

    def one(_: int) -> Any:
        try:
            return c.completions.create(model="m", prompt=FLOOD, max_tokens=48)
        except openai.APIStatusError as exc:
            return exc

    with ThreadPoolExecutor(16) as ex:
        results = list(ex.map(one, range(16)))
    shed = [r for r in results if isinstance(r, openai.APIStatusError)]
    assert shed and len(shed) < len(results)
    for exc in shed:
        assert exc.status_code == 429 and exc.response.headers["retry-after"] in ("1", "2")
        assert isinstance(exc.body, dict)
        assert exc.body["code"] in ("flow_control_queue_full", "flow_control_timeout")
        assert set(exc.body) == {"message", "type", "param", "code"}
    gate = gw.state.flow.gates["m"].gate
    assert gate.queue.size == 0 and gate.let_through == 0  # nothing left behind


def test_a_bad_fairness_id_is_a_400(engine: RunningBackend,
                                    gateways: Callable[[dict[str, Any]], RunningGateway]
                                    ) -> None:
    gw = gateways(policy(f"{engine.url}/v1", "fair"))
    r = httpx.post(f"{gw.url}/v1/completions", headers={
        "Authorization": "Bearer key-light", "x-fairness-id": "has space"},
        json={"model": "m", "prompt": "x", "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "x-fairness-id"
    r = httpx.post(f"{gw.url}/v1/completions", headers={
        "Authorization": "Bearer key-light", "x-fairness-id": "session-7"},
        json={"model": "m", "prompt": "x", "max_tokens": 1})
    assert r.status_code == 200
    counters = gw.state.flow.gates["m"].gate.queue.counters
    # the session is served within its tenant's share: only the tenant has a shared counter
    assert counters.get("light", 0) > 0 and "light/session-7" not in counters


def test_a_clients_priority_never_reaches_the_engine(
        engine: RunningBackend, gateways: Callable[[dict[str, Any]], RunningGateway]) -> None:
    """The engine (fcfs, as vLLM without --scheduling-policy priority) refuses a 'priority';
    through the gateway the client's is dropped, so it cannot jump the engine's queue."""
    body = {"model": "llama-3-8b", "prompt": "hi", "max_tokens": 2, "priority": -100}
    direct = httpx.post(f"{engine.url}/v1/completions", json=body)
    assert direct.status_code == 400 and direct.json()["error"]["param"] == "priority"
    gw = gateways(policy(f"{engine.url}/v1", "fair"))
    r = httpx.post(f"{gw.url}/v1/completions", headers={"Authorization": "Bearer key-light"},
                   json={**body, "model": "m"})
    assert r.status_code == 200, r.text


def test_engine_priority_puts_a_light_flow_ahead_of_a_backlogged_one_in_the_engine(
        backend_factory: Factory, gateways: Callable[[dict[str, Any]], RunningGateway]
        ) -> None:
    """With ``engine_priority`` each request carries a ``priority`` for the engine's queue: the
    flooding flow, backlogged in the gateway, 5; the light flow, which has nothing else
    waiting, 4 (both standard); the engine (``--scheduling-policy priority``) orders by it."""
    eng = backend_factory(time_scale=0.5, max_num_seqs=2, scheduling_policy="priority")
    seen: list[tuple[int, int]] = []  # (prompt tokens, priority) as the engine got them
    sched = eng.state.engine.scheduler
    add = sched.add

    def spy(req: Any) -> None:
        seen.append((req.num_prompt_tokens, req.priority))
        add(req)

    sched.add = spy  # type: ignore[method-assign]
    gw = gateways(policy(f"{eng.url}/v1", "fair", engine_priority=True))
    stop = threading.Event()
    pool = flood(gw, stop, 12)
    try:
        time.sleep(1.0)
        victim_ttfts(gw, 4)
    finally:
        stop.set()
        pool.shutdown(wait=True)
    light = {p for n, p in seen if n < 20}
    heavy = {p for n, p in seen if n > 100}
    assert light == {4}, seen
    assert 5 in heavy and heavy <= {4, 5}, seen


def test_a_request_abandoned_while_it_waits_is_recorded_and_counted_once(
        engine: RunningBackend, gateways: Callable[[dict[str, Any]], RunningGateway]) -> None:
    """The light tenant's requests wait in the gateway's queue behind a saturated engine and
    their clients hang up before a token: each leaves exactly one spend record and one count
    (``client_gone``), and its reservation is returned."""
    doc = policy(f"{engine.url}/v1", "priority")
    doc["tenants"]["light"]["priority"] = "flex"  # it waits while the flood has the engine
    doc["tenants"]["light"]["limits"] = {"tpm": 1_000_000}
    gw = gateways(doc)
    records: list[Any] = []
    gw.state.spend.sinks.append(type("Sink", (), {"put": lambda _s, r: records.append(r)})())
    stop = threading.Event()
    pool = flood(gw, stop, 12)
    try:
        time.sleep(1.0)
        gone = []
        for i in range(3):
            rid = f"gone-{i}-{time.monotonic_ns()}"
            gone.append(rid)
            with pytest.raises(httpx.TimeoutException):
                httpx.post(f"{gw.url}/v1/completions", timeout=0.3,
                           headers={"Authorization": "Bearer key-light", "x-request-id": rid},
                           json={"model": "m", "prompt": "hello", "max_tokens": 4})
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and \
                sum(r.request_id in gone for r in records) < len(gone):
            time.sleep(0.05)
    finally:
        stop.set()
        pool.shutdown(wait=True)
    mine = [r for r in records if r.request_id in gone]
    assert sorted(r.request_id for r in mine) == sorted(gone)  # one each
    assert {(r.outcome, r.dollars, r.completion_tokens) for r in mine} == {("client_gone", 0, 0)}
    text = httpx.get(f"{gw.url}/metrics").text
    counted = [x for x in text.splitlines() if x.startswith("tokengate_requests_total{")
               and 'tenant="light"' in x]
    assert len(counted) == 1 and 'status="client_gone"' in counted[0], counted
    assert float(counted[0].split()[-1]) == len(gone)


def test_an_engine_without_metrics_is_served_under_fair_flow_control(
        gateways: Callable[[dict[str, Any]], RunningGateway]) -> None:
    """An OpenAI-compatible server without ``/metrics`` (404) is reachable, not down: the gate
    counts its room by what the gateway sent it, and a request goes at once (it used to wait
    forever in the gateway's queue while routing, under ``fcfs``, would have sent it)."""
    port = free_port()

    async def serve(ready: asyncio.Event, stop: asyncio.Event) -> None:
        runner = web.AppRunner(build(4))
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        ready.set()
        await stop.wait()
        await runner.cleanup()

    server = start_server_thread(serve, "echo-upstream")
    try:
        gw = gateways(policy(f"http://127.0.0.1:{port}/v1", "fair"))
        c = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="key-light", max_retries=0,
                          timeout=20)
        time.sleep(1.0)  # several scrapes answered 404
        for _ in range(3):
            r = c.chat.completions.create(model="m", max_tokens=4,
                                          messages=[{"role": "user", "content": "hi"}])
            assert r.choices[0].message.content
    finally:
        server.close()
