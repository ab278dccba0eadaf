"""Every admitted reservation is settled exactly once, whatever happens after admission: ten
clients that leave before their first token -- waiting on a stalled backend, queued for an
SLO, held while a pool wakes from zero, or a non-streamed request whose client times out --
leave the tenant's buckets exactly where ten refused requests would (nothing charged)."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import RunningBackend
from gateway_stack import RunningGateway
from ledger import AUTH, charged, ledger_gateway, policy

from backend.faults import FaultConfig

Factory = Callable[..., RunningBackend]
CLIENTS = 10


@pytest.fixture
def gateways(tmp_path: Path) -> Iterator[Callable[[dict[str, Any]], RunningGateway]]:
    started: list[RunningGateway] = []

    def make(doc: dict[str, Any]) -> RunningGateway:
        gw = ledger_gateway(tmp_path, doc)
        started.append(gw)
        return gw

    yield make
    for gw in started:
        gw.close()


def abandon(gw: RunningGateway, *, stream: bool, headers: dict[str, str] | None = None,
            after_s: float = 0.5) -> None:
    """CLIENTS clients at once, each giving up ``after_s`` into its request."""
    def one(i: int) -> str:
        try:
            with httpx.stream("POST", f"{gw.url}/v1/completions", timeout=after_s,
                              headers={**AUTH, **(headers or {})},
                              json={"model": "m", "prompt": f"hello {i} " * 50,
                                    "max_tokens": 200, "stream": stream}) as r:
                r.read()
                return f"answered {r.status_code}"
        except httpx.TimeoutException:
            return "gave up"

    with ThreadPoolExecutor(CLIENTS) as pool:
        outcomes = list(pool.map(one, range(CLIENTS)))
    assert outcomes == ["gave up"] * CLIENTS


@pytest.mark.parametrize("stream", [True, False])
def test_clients_that_leave_a_stalled_backend_are_charged_nothing(
        stream: bool, backend_factory: Factory,
        gateways: Callable[[dict[str, Any]], RunningGateway]) -> None:
    b = backend_factory(served_model_name="up", time_scale=0.02,
                        faults=FaultConfig(stall_s=3.0))
    gw = gateways(policy([f"{b.url}/v1"]))
    abandon(gw, stream=stream)
    assert charged(gw) == (0.0, 0.0)


def test_clients_that_leave_an_slo_queue_are_charged_nothing(
        backend_factory: Factory, gateways: Callable[[dict[str, Any]], RunningGateway]) -> None:
    b = backend_factory(served_model_name="up", time_scale=0.02)
    gw = gateways(policy([f"{b.url}/v1"], route={"on_slo_miss": "queue", "queue_ms": 5000}))
    # No endpoint can meet a 0.001 ms TTFT: every request queues for up to 5 s.
    abandon(gw, stream=True, headers={"x-slo-ttft-ms": "0.001"})
    assert charged(gw) == (0.0, 0.0)


def test_clients_that_leave_a_pool_waking_from_zero_are_charged_nothing(
        gateways: Callable[[dict[str, Any]], RunningGateway]) -> None:
    never_ready = [sys.executable, "-c", "import time; time.sleep(30)", "{port}"]
    doc = policy([], route={"hold_timeout_ms": 10_000})
    doc["models"]["m"]["scaling"] = {"min_replicas": 0, "max_replicas": 1,
                                     "launcher": {"kind": "command", "command": never_ready}}
    gw = gateways(doc)
    abandon(gw, stream=True)
    assert charged(gw) == (0.0, 0.0)


def test_a_request_served_after_others_left_is_charged_in_full(
        backend_factory: Factory, gateways: Callable[[dict[str, Any]], RunningGateway]) -> None:
    """The control: the same gateway charges what it serves (so the zeros above mean
    refunds, not a store that was never written)."""
    b = backend_factory(served_model_name="up", time_scale=0.02,
                        faults=FaultConfig(stall_s=1.0))
    gw = gateways(policy([f"{b.url}/v1"]))
    abandon(gw, stream=True, after_s=0.3)
    r = httpx.post(f"{gw.url}/v1/completions", headers=AUTH, timeout=30,
                   json={"model": "m", "prompt": "hello", "max_tokens": 3})
    assert r.status_code == 200, r.text
    u = r.json()["usage"]
    assert charged(gw) == (float(u["prompt_tokens"] + u["completion_tokens"]), 1.0)
