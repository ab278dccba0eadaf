"""Envoy's ext_proc messages as the EPP reads and writes them (``envoy.service.ext_proc.v3``,
as declared in ``gateway/epp/proto/ext_proc.proto``): a request's headers as a
case-insensitive mapping, header mutations, the streamed body answers of
``FULL_DUPLEX_STREAMED`` mode, the dynamic metadata GIE's protocol names, and our
OpenAI-shaped errors as immediate responses."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import cast

import orjson
from multidict import CIMultiDict, CIMultiDictProxy

from gateway.epp.proto import ext_proc_pb2 as pb
from protocol.errors import APIError

# GIE's endpoint picker protocol (v1.0): the chosen endpoint, in a header and in dynamic
# metadata under this namespace (same key, same value); the subset a proxy may narrow to.
DESTINATION = "x-gateway-destination-endpoint"
LB_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_HEADER = "x-gateway-destination-endpoint-subset"
SERVED = "x-gateway-destination-endpoint-served"
# Envoy's own header for the retries of one request: the EPP sets it to the fallbacks it
# named, so the proxy walks the list and no further (never past the EPP's choice).
MAX_RETRIES = "x-envoy-max-retries"
# GIE names a request's InferenceObjective in this header; ours are named after the
# priorities they stand for (deploy/k8s/gie/objectives.yaml), so the name is the priority.
OBJECTIVE = "x-gateway-inference-objective"


def header_map(h: pb.HttpHeaders) -> CIMultiDictProxy[str]:
    """The headers Envoy sent (pseudo-headers such as ``:path`` included), case-insensitive.
    Envoy fills ``raw_value`` (bytes); older ones ``value``."""
    out: CIMultiDict[str] = CIMultiDict()
    for hv in h.headers.headers:
        out.add(hv.key, hv.raw_value.decode("utf-8", "surrogateescape") if hv.raw_value
                else hv.value)
    return CIMultiDictProxy(out)


def with_objective(h: CIMultiDictProxy[str]) -> CIMultiDictProxy[str]:
    """``h``, with the objective's priority as ``x-priority`` when only an objective is named
    (an explicit ``x-priority`` wins)."""
    objective = h.get(OBJECTIVE)
    if objective is None or "x-priority" in h:
        return h
    out = CIMultiDict(h)
    out["x-priority"] = objective
    return CIMultiDictProxy(out)


_OVERWRITE = pb.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD


def fill(m: pb.HeaderMutation, set_: Mapping[str, str], remove: Iterable[str] = ()) -> None:
    """Write ``set_`` (each header replaced or added) and ``remove`` into ``m``, in place.

    Every message of an answer is filled where it lies in the answer: a message passed to a
    constructor is copied (and its bytes with it) at each level of nesting, which made
    building the answers' headers and bodies ~7 % of the EPP's CPU per request."""
    add = m.set_headers.add
    for k, v in set_.items():
        header = add(append_action=_OVERWRITE).header
        header.key = k
        header.raw_value = v.encode()
    if remove:
        m.remove_headers.extend(remove)


def request_headers(set_: Mapping[str, str], remove: Iterable[str], destination: str
                    ) -> pb.ProcessingResponse:
    """The answer to the request's headers, sent once its body was read and routed: the
    destination in the header and in ``envoy.lb`` metadata; the route cache cleared, so a
    route that matches on the destination (or the rewritten model) sees it."""
    r = pb.ProcessingResponse()
    common = r.request_headers.response
    fill(common.header_mutation, {**set_, DESTINATION: destination}, remove)
    common.clear_route_cache = True
    r.dynamic_metadata.update({LB_NAMESPACE: {DESTINATION: destination}})
    return r


def response_headers(set_: Mapping[str, str], remove: Iterable[str] = ()
                     ) -> pb.ProcessingResponse:
    r = pb.ProcessingResponse()
    fill(r.response_headers.response.header_mutation, set_, remove)
    return r


# The most body bytes one streamed answer carries. GIE's EPP splits bodies at 62,000 bytes,
# since some Envoy deployments take at most 64 KiB per streamed chunk
# (gateway-api-inference-extension, pkg/common/envoy: BodyByteLimit); a multi-megabyte body
# sent as one answer also holds the event loop while it is built and serialized, where its
# pieces are written one per step.
BODY_CHUNK_BYTES = 62_000


def body(data: bytes, end: bool, *, response: bool) -> list[pb.ProcessingResponse]:
    """The streamed body answers carrying ``data`` (``FULL_DUPLEX_STREAMED``: what we return
    replaces what Envoy sent), in pieces of at most ``BODY_CHUNK_BYTES``; ``end`` closes the
    body with the last."""
    n = BODY_CHUNK_BYTES
    out = []
    for i in range(0, len(data) or 1, n):  # an empty body is one empty piece
        r = pb.ProcessingResponse()
        piece = (r.response_body if response else r.request_body
                 ).response.body_mutation.streamed_response
        piece.body = data[i:i + n]  # the bytes themselves when they fit in one
        piece.end_of_stream = end and i + n >= len(data)
        out.append(r)
    return out


def trailers(*, response: bool) -> pb.ProcessingResponse:
    if response:
        return pb.ProcessingResponse(response_trailers=pb.TrailersResponse())
    return pb.ProcessingResponse(request_trailers=pb.TrailersResponse())


def immediate(status: int, payload: bytes, headers: Mapping[str, str],
              details: str) -> pb.ProcessingResponse:
    r = pb.ProcessingResponse()
    answer = r.immediate_response
    answer.status.code = cast("pb.StatusCode", status)
    fill(answer.headers, {"content-type": "application/json", **headers})
    answer.body = payload
    answer.details = details
    return r


def error(exc: APIError, extra: Mapping[str, str] | None = None) -> pb.ProcessingResponse:
    """Our error, answered by Envoy in place of the upstream's response: OpenAI's shape,
    its status, its headers (``retry-after``, rate-limit headers)."""
    payload = orjson.dumps({"error": {"message": exc.message, "type": exc.type,
                                      "param": exc.param, "code": exc.code}})
    return immediate(exc.status, payload, {**(extra or {}), **exc.headers},
                     f"tokengate_{exc.code or exc.status}")


def subset(req: pb.ProcessingRequest, headers: Mapping[str, str], trust_header: bool = False
           ) -> set[str] | None:
    """The ``ip:port`` candidates the proxy narrowed this request to, from the filter
    metadata it sent (``envoy.lb.subset_hint``), or the subset header when ``trust_header``
    (a client sends headers: one could pin itself to a pod); None: any. A subset key that is
    set but empty narrows to nothing (the protocol: a 503)."""
    ns = req.metadata_context.filter_metadata.get(SUBSET_NAMESPACE)
    if ns is not None and SUBSET_HEADER in ns.fields:
        v = ns.fields[SUBSET_HEADER]
        found = ([x.string_value for x in v.list_value.values] if v.HasField("list_value")
                 else v.string_value.split(","))
        return {x.strip() for x in found if x.strip()}
    if trust_header and headers.get(SUBSET_HEADER):
        return {x.strip() for x in headers[SUBSET_HEADER].split(",") if x.strip()} or None
    return None


def served(req: pb.ProcessingRequest, headers: Mapping[str, str]) -> str | None:
    """The ``ip:port`` the proxy says served the request: the protocol's
    ``envoy.lb`` metadata, else the response header of the same name; None if neither."""
    ns = req.metadata_context.filter_metadata.get(LB_NAMESPACE)
    if ns is not None and SERVED in ns.fields:
        value = ns.fields[SERVED].string_value.strip()
        if value:
            return value
    return headers.get(SERVED) or None
