"""Endpoints discovered while the gateway runs: an InferencePool's ready pods through the
Kubernetes API (the official ``kubernetes`` client's list and watch), and a headless
Service's addresses through DNS.

No cluster can run where these tests run. The API server is ``tests/kube_api.py``: a stand-in
on loopback that speaks the list/watch protocol the client uses (resource versions, watch
events, bookmarks, a 410 Gone after compaction, bearer-token auth), reached through an
ordinary kubeconfig. The "pods" are real reference backends, each on its own loopback
address (127.0.0.2, .3, ...) and the pool's one target port, as pods share a port on
different IPs; the gateway is ``tokengate serve`` with the official ``openai`` client."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from conftest import RunningBackend
from gateway_stack import RunningGateway, start_gateway, write_policy
from kube_api import KubeAPI, pod
from test_gateway_e2e import sha

from gateway.config.discovery import Discovery
from gateway.config.policy import PolicyError, load_policy
from gateway.discovery import dns
from gateway.discovery.pods import addresses, pool_target, ready

Factory = Callable[..., RunningBackend]
LABELS = {"app.kubernetes.io/name": "vllm"}
IPS = ("127.0.0.2", "127.0.0.3", "127.0.0.4")


def free_port_on_all(ips: tuple[str, ...]) -> int:
    """A port free on every one of ``ips`` (the pool's single target port)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        try:
            for ip in ips:
                with socket.socket() as t:
                    t.bind((ip, port))
        except OSError:
            continue
        return port
    raise RuntimeError("no port free on every loopback address")


def policy(tmp_path: Path, discovery: dict[str, Any]) -> Path:
    return write_policy(tmp_path / "policy.yaml", {
        "version": 1,
        "settings": {"admin_key_sha256": sha("admin-key")},
        "models": {"m": {"endpoints": [], "discovery": discovery,
                         "upstream_model": "llama-3-8b",
                         "routing": {"strategy": "round_robin"}}},
        "tenants": {"t": {"keys": [{"name": "k", "sha256": sha("key-t")}]}},
        "routes": {"r": {"tenants": ["t"], "models": ["m"]}}})


def wait_for(what: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if what():
            return
        time.sleep(0.02)
    raise AssertionError("timed out")


def urls(gw: RunningGateway) -> set[str]:
    return {e.url for e in gw.state.view.pools["m"].endpoints}


def served(backends: dict[str, RunningBackend]) -> dict[str, int]:
    return {ip: b.state.engine.submitted for ip, b in backends.items()}


@pytest.fixture
def fleet(backend_factory: Factory, tmp_path: Path
          ) -> Iterator[tuple[KubeAPI, RunningGateway, dict[str, RunningBackend], int]]:
    port = free_port_on_all(IPS)
    backends = {ip: backend_factory(host=ip, port=port, served_model_name="llama-3-8b",
                                    time_scale=0.02) for ip in IPS}
    api = KubeAPI()
    api.set_pool("vllm-pool", LABELS, [port])
    api.put_pod(pod("vllm-0", IPS[0], LABELS))
    api.put_pod(pod("vllm-1", IPS[1], LABELS))
    api.put_pod(pod("other", IPS[2], {"app.kubernetes.io/name": "something-else"}))
    gw = start_gateway(policy(tmp_path, {"inference_pool": "vllm-pool", "namespace": "llm",
                                         "kubeconfig": str(api.kubeconfig(
                                             tmp_path / "kubeconfig"))}))
    try:
        yield api, gw, backends, port
    finally:
        gw.close()
        api.close()


def chat(gw: RunningGateway, n: int) -> None:
    with openai.OpenAI(base_url=f"{gw.url}/v1", api_key="key-t", max_retries=0) as c:
        for _ in range(n):
            r = c.chat.completions.create(model="m", max_tokens=2,
                                          messages=[{"role": "user", "content": "hi"}])
            assert r.usage is not None and r.usage.completion_tokens == 2


def test_pods_are_followed_as_they_come_go_and_turn_unready(
        fleet: tuple[KubeAPI, RunningGateway, dict[str, RunningBackend], int]) -> None:
    api, gw, backends, port = fleet
    url = {ip: f"http://{ip}:{port}/v1" for ip in IPS}
    # the first list: the two pods the selector matches, not the third
    wait_for(lambda: urls(gw) == {url[IPS[0]], url[IPS[1]]})
    chat(gw, 4)
    assert served(backends) == {IPS[0]: 2, IPS[1]: 2, IPS[2]: 0}
    # a pod is added: no restart, it takes requests
    api.put_pod(pod("vllm-2", IPS[2], LABELS))
    wait_for(lambda: url[IPS[2]] in urls(gw))
    chat(gw, 3)
    assert served(backends)[IPS[2]] >= 1
    # a pod turns unready (its readiness probe failed): out of rotation at once
    api.set_ready("vllm-0", False)
    wait_for(lambda: url[IPS[0]] not in urls(gw))
    before = served(backends)[IPS[0]]
    chat(gw, 4)
    assert served(backends)[IPS[0]] == before
    # ready again: back in; deleted: out
    api.set_ready("vllm-0", True)
    wait_for(lambda: url[IPS[0]] in urls(gw))
    api.delete_pod("vllm-1")
    wait_for(lambda: urls(gw) == {url[IPS[0]], url[IPS[2]]})
    assert set(gw.state.view.pools["m"].api_keys) == urls(gw)  # nothing kept of the gone
    # the pool's one watch carried it all: listed once, then watched from the list's version
    # with bookmarks
    w = gw.state.discoverer.followers["m"].watcher
    assert w.counts["lists"] == 1 and w.counts["events"] >= 4
    watches = api.requests("/pods")
    assert watches[0].get("watch") is None  # the list
    assert all(q.get("allowWatchBookmarks") == "true" and q.get("resourceVersion")
               for q in watches[1:])
    wait_for(lambda: w.counts["bookmarks"] >= 1)
    status = gw.state.discoverer.status()["m"]
    assert status["synced"] and sorted(e["url"] for e in status["endpoints"]) == \
        sorted(urls(gw))


def test_a_watch_that_is_too_old_relists_and_misses_nothing(
        fleet: tuple[KubeAPI, RunningGateway, dict[str, RunningBackend], int]) -> None:
    """History compacted, the watch connection dropped, pods changed meanwhile: the watch
    from the old version is answered 410 Gone, the watcher lists again, and the pool is what
    the API server holds."""
    api, gw, backends, port = fleet
    url = {ip: f"http://{ip}:{port}/v1" for ip in IPS}
    wait_for(lambda: len(urls(gw)) == 2)
    w = gw.state.discoverer.followers["m"].watcher
    api.compact()
    api.delete_pod("vllm-0")  # these two changes happen while no watch can see them
    api.put_pod(pod("vllm-2", IPS[2], LABELS))
    api.drop_watches()
    # (the live watch may see the changes before the cut: either way the pool ends right)
    api.compact()
    api.drop_watches()
    wait_for(lambda: urls(gw) == {url[IPS[1]], url[IPS[2]]})
    wait_for(lambda: w.counts["relists_gone"] >= 1 and w.counts["lists"] >= 2)
    chat(gw, 2)
    assert served(backends)[IPS[0]] == 0


def test_a_request_in_flight_to_a_removed_pod_finishes(
        fleet: tuple[KubeAPI, RunningGateway, dict[str, RunningBackend], int]) -> None:
    """A pod leaves the pool (scale-in: terminating, still serving for its grace period):
    the stream it is serving ends whole, and nothing new goes there."""
    api, gw, backends, _ = fleet
    wait_for(lambda: len(urls(gw)) == 2)
    got: list[int] = []

    def stream() -> None:
        with openai.OpenAI(base_url=f"{gw.url}/v1", api_key="key-t", max_retries=0) as c:
            n = 0
            for ch in c.completions.create(model="m", prompt="x", max_tokens=120, stream=True,
                                           extra_body={"ignore_eos": True}):
                n += sum(1 for c_ in ch.choices if c_.text)
            got.append(n)

    t = threading.Thread(target=stream)
    t.start()
    wait_for(lambda: sum(served(backends).values()) == 1 or bool(got))
    busy = next(ip for ip, n in served(backends).items() if n == 1)
    api.delete_pod("vllm-0" if busy == IPS[0] else "vllm-1")
    t.join(30)
    assert got == [120]
    chat(gw, 3)
    assert served(backends)[busy] == 1


def test_not_ready_until_the_first_list_and_kept_on_api_errors(backend_factory: Factory,
                                                                tmp_path: Path) -> None:
    """A gateway whose credentials the API server refuses is alive but not ready (it has no
    endpoints to route to); it keeps trying and becomes ready once it can list."""
    api = KubeAPI()
    port = free_port_on_all(IPS[:1])
    b = backend_factory(host=IPS[0], port=port, served_model_name="llama-3-8b",
                        time_scale=0.02)
    api.set_pool("vllm-pool", LABELS, [port])
    api.put_pod(pod("vllm-0", IPS[0], LABELS))
    cfg = api.kubeconfig(tmp_path / "kubeconfig", token="wrong")
    gw = start_gateway(policy(tmp_path, {"inference_pool": "vllm-pool", "namespace": "llm",
                                         "kubeconfig": str(cfg)}))
    try:
        import httpx

        wait_for(lambda: gw.state.discoverer.followers.get("m") is not None
                 and gw.state.discoverer.followers["m"].watcher.counts["errors"] >= 1)
        assert httpx.get(f"{gw.url}/ready").status_code == 503
        assert httpx.get(f"{gw.url}/health").status_code == 200
        assert "401" in (gw.state.discoverer.followers["m"].watcher.last_error or "")
        api.kubeconfig(cfg)  # the right token (a rotated secret, remounted): after an error
        # the watcher builds its client anew, from the file
        wait_for(lambda: httpx.get(f"{gw.url}/ready").status_code == 200, 15)
        chat(gw, 1)
        assert b.state.engine.submitted == 1
    finally:
        gw.close()
        api.close()


def test_dns_discovery_follows_what_the_name_resolves_to(backend_factory: Factory,
                                                         tmp_path: Path) -> None:
    b = backend_factory(served_model_name="llama-3-8b", time_scale=0.02)
    gw = start_gateway(policy(tmp_path, {"dns": "127.0.0.1", "port": b.config.port,
                                         "interval_s": 0.1}))
    try:
        wait_for(lambda: urls(gw) == {f"{b.url}/v1"})
        chat(gw, 2)
    finally:
        gw.close()


async def test_a_names_addresses_are_those_the_resolver_gives() -> None:
    got = await dns.resolve("localhost", 8000)
    want = {(str(i[4][0]), 8000, "both") for i in socket.getaddrinfo("localhost", 8000,
                                                              type=socket.SOCK_STREAM)}
    assert set(got) == want and got == sorted(got)


def test_pool_and_pod_readings() -> None:
    p = {"spec": {"selector": {"matchLabels": {"b": "2", "a": "1"}},
                  "targetPorts": [{"number": 8000}, {"number": 8001}]}}
    t = pool_target(p)
    assert t.selector == "a=1,b=2" and t.ports == (8000, 8001)
    assert pool_target(p, 9000).ports == (9000,)
    with pytest.raises(ValueError, match="matchLabels"):
        pool_target({"spec": {"targetPorts": [{"number": 1}]}})
    ok = pod("x", "10.0.0.1", {})
    assert ready(ok)
    terminating = pod("y", "10.0.0.2", {})
    terminating["metadata"]["deletionTimestamp"] = "2026-12-03T00:00:00Z"
    pending = pod("z", "10.0.0.3", {})
    pending["status"]["phase"] = "Pending"
    no_ip = pod("w", "", {})
    assert not any(ready(p_) for p_ in (terminating, pending, no_ip,
                                        pod("v", "10.0.0.4", {}, ready=False)))
    assert addresses([ok, terminating], (8000, 8001)) == [("10.0.0.1", 8000, "both"),
                                                          ("10.0.0.1", 8001, "both")]
    prefill = pod("p", "10.0.0.5", {"llm-d.ai/role": "prefill"})
    decode = pod("d", "10.0.0.6", {"llm-d.ai/role": "decode", "x": "y"})
    odd = pod("o", "10.0.0.7", {"llm-d.ai/role": "router"})
    assert addresses([prefill, decode, odd], (1,)) == [
        ("10.0.0.5", 1, "prefill"), ("10.0.0.6", 1, "decode"), ("10.0.0.7", 1, "both")]


def test_the_policy_says_what_is_wrong_with_a_discovery_section(tmp_path: Path) -> None:
    for section, words in (({"dns": "x"}, "needs the engines' port"),
                           ({"inference_pool": "p", "dns": "x", "port": 1}, "exactly one"),
                           ({}, "exactly one"),
                           ({"dns": "x", "port": 1, "namespace": "n"}, "inference_pool"),
                           ({"inference_pool": "p", "path": "v1"}, "URL path"),
                           ({"inference_pool": "p", "port": 70000}, "TCP port")):
        with pytest.raises(PolicyError, match=words):
            load_policy(policy(tmp_path, section))
    m = load_policy(policy(tmp_path, {"inference_pool": "p"})).models["m"]
    assert m.discovery == Discovery("inference_pool", "p") and m.endpoints == ()


def test_a_pods_role_label_makes_the_pool_disaggregated(
        fleet: tuple[KubeAPI, RunningGateway, dict[str, RunningBackend], int]) -> None:
    """llm-d's ``llm-d.ai/role`` label on a pod gives its endpoint that role: a pool with a
    prefill pod prefills there and decodes on the others."""
    api, gw, _, port = fleet
    wait_for(lambda: len(urls(gw)) == 2)
    assert not gw.state.view.pools["m"].disaggregated
    api.put_pod(pod("vllm-2", IPS[2], {**LABELS, "llm-d.ai/role": "prefill"}))
    wait_for(lambda: len(urls(gw)) == 3)
    roles = {e.url: e.role for e in gw.state.view.pools["m"].endpoints}
    assert roles == {f"http://{IPS[0]}:{port}/v1": "both", f"http://{IPS[1]}:{port}/v1": "both",
                     f"http://{IPS[2]}:{port}/v1": "prefill"}
    assert gw.state.view.pools["m"].disaggregated
