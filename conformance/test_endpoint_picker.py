"""Conformance of an Endpoint Picker to the Gateway API Inference Extension's endpoint-picker
protocol, v1.0.0 (proposal 004, ``docs/proposals/004-endpoint-picker-protocol/README.md`` in
kubernetes-sigs/gateway-api-inference-extension). Each case cites the clause it checks, by
section and words. Cases either go through a real Envoy (``plane.url``) or speak ext_proc to
the EPP directly, as Envoy does (``exchange``)."""

from __future__ import annotations

import re

import grpc
import httpx
import pytest
from conftest import Plane
from grpc_health.v1 import health_pb2, health_pb2_grpc
from protocol_msgs import destination, immediate_status, request

from gateway.epp.proto import ext_proc_pb2 as pb
from gateway.epp.service import client

HOSTPORT = re.compile(r"^(\d{1,3}(\.\d{1,3}){3}|\[[0-9a-fA-F:]+\]):\d{1,5}$")
SERVED = "x-gateway-destination-endpoint-served"
CHAT = "/v1/chat/completions"


def chat_body(plane: Plane, **over: object) -> dict[str, object]:
    return {"model": plane.model, "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": 3, **over}


def exchange(plane: Plane, subset: list[str] | None = None) -> list[pb.ProcessingResponse]:
    """One request's headers and body sent to the EPP as Envoy sends them; every answer."""
    msgs = request(CHAT, chat_body(plane), plane.headers(), subset)
    return list(client(plane.channel)(iter(msgs), timeout=30))


def endpoints(value: str) -> list[str]:
    return [e.strip() for e in value.split(",")]


# -- "The EPP MUST implement the Envoy external processing service protocol" and "MUST support
# -- streaming mode for inference requests and responses" ---------------------------------

def test_requests_and_streams_are_served_through_the_proxy(plane: Plane) -> None:
    """Overview: ext_proc, streaming mode. A whole answer and a token stream both come back
    through Envoy, the stream event by event to its end."""
    with httpx.Client(base_url=plane.url, headers=plane.headers(), timeout=60) as c:
        r = c.post(CHAT, json=chat_body(plane))
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"]
        events = []
        with c.stream("POST", CHAT, json=chat_body(plane, stream=True)) as s:
            assert s.status_code == 200
            events = [line for line in s.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]" and len(events) >= 2


# -- "Destination Endpoint" ---------------------------------------------------------------

def test_the_destination_is_in_the_header_and_the_metadata_alike(plane: Plane) -> None:
    """Destination Endpoint: "the EPP MUST communicate to the data plane one or more
    selected model server endpoints via" the ``x-gateway-destination-endpoint`` header and
    an ``envoy.lb`` dynamic metadata entry of the same key; "The EPP MUST not set two
    different values in the header and the inner response metadata value"."""
    header, meta = destination(exchange(plane))
    assert header is not None, "no x-gateway-destination-endpoint header"
    assert meta is not None, "no envoy.lb/x-gateway-destination-endpoint metadata"
    assert header == meta


def test_the_destination_lists_pool_endpoints_as_ip_port(plane: Plane) -> None:
    """Destination Endpoint: "MUST contain at least one endpoint in <ip:port> format or
    multiple endpoints in <ip:port>,<ip:port>,... format"; the endpoints are the pool's
    ("Ultimately it's responsible for picking an endpoint from the InferencePool")."""
    for _ in range(5):
        header, _ = destination(exchange(plane))
        assert header is not None
        listed = endpoints(header)
        assert listed and all(HOSTPORT.match(e) for e in listed), header
        assert set(listed) <= plane.pool, (listed, plane.pool)
        assert len(set(listed)) == len(listed), f"an endpoint listed twice: {header}"


def test_the_endpoint_that_served_was_listed(plane: Plane) -> None:
    """Destination Endpoint Served: the proxy reports the endpoint that served; it is the
    first of the EPP's list when that one is up."""
    with httpx.Client(base_url=plane.url, headers=plane.headers(), timeout=60) as c:
        for _ in range(4):
            r = c.post(CHAT, json=chat_body(plane))
            assert r.status_code == 200, r.text
            assert r.headers.get(SERVED) in plane.pool


# -- "Endpoint Subset" --------------------------------------------------------------------

def test_a_subset_is_respected(plane: Plane) -> None:
    """Endpoint Subset: "If the key x-gateway-destination-endpoint-subset is set, the EPP
    MUST only select endpoints from the specified list"."""
    for only in sorted(plane.pool):
        header, _ = destination(exchange(plane, [only]))
        assert header is not None and endpoints(header) == [only], (only, header)
    two = sorted(plane.pool)[:2]
    for _ in range(4):
        header, _ = destination(exchange(plane, two))
        assert header is not None and set(endpoints(header)) <= set(two)


def test_a_subset_with_nothing_eligible_is_a_503(plane: Plane) -> None:
    """Endpoint Subset: "If none of the endpoints in the list is eligible or the list is
    empty, then the EPP MUST return a ImmediateResponse with 503"."""
    assert immediate_status(exchange(plane, ["192.0.2.1:9"])) == 503  # TEST-NET-1
    assert immediate_status(exchange(plane, [])) == 503


# -- fallbacks ("If retry is configured, the proxy will go sequentially down the list") --

def test_the_first_endpoint_dead_the_next_serves_and_the_client_sees_no_error(
        plane: Plane) -> None:
    """Destination Endpoint, v0.4.0 "multiple fallback endpoints": "The first valid endpoint
    in the list will be used. If retry is configured, the proxy will go sequentially down
    the list until one valid endpoint is found." One model server is killed; requests sent
    right after (before health checks can have noticed) all succeed. Not applicable to an
    EPP that names one endpoint per request."""
    header, _ = destination(exchange(plane))
    if header is None or len(endpoints(header)) < 2:
        pytest.skip("the EPP names a single endpoint: no fallback to walk")
    victim = plane.servers[0]
    victim.kill()
    plane.stopped.append(victim)
    codes, served = [], set()
    with httpx.Client(base_url=plane.url, headers=plane.headers(), timeout=60) as c:
        for _ in range(6):
            r = c.post(CHAT, json=chat_body(plane))
            codes.append(r.status_code)
            served.add(r.headers.get(SERVED))
    assert codes == [200] * 6, codes
    assert victim.hostport not in served


# -- "Health Checking" --------------------------------------------------------------------

@pytest.mark.parametrize("service", ["liveness", "readiness",
                                     "envoy.service.ext_proc.v3.ExternalProcessor"])
def test_health_services_answer_serving(plane: Plane, service: str) -> None:
    """Health Checking: the EPP exposes the gRPC Health Checking Protocol with the services
    ``liveness``, ``readiness`` and ``envoy.service.ext_proc.v3.ExternalProcessor``, SERVING
    when alive / ready (a single replica, its endpoints known)."""
    stub = health_pb2_grpc.HealthStub(plane.channel)
    try:
        got = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
    except grpc.RpcError as exc:
        pytest.fail(f"health service {service!r}: {exc.code()}")
    assert got.status == health_pb2.HealthCheckResponse.SERVING
