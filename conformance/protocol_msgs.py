"""ext_proc messages as Envoy sends them to an EPP, for the cases that speak to it directly."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import orjson
from google.protobuf import struct_pb2

from gateway.epp.proto import ext_proc_pb2 as pb

DESTINATION = "x-gateway-destination-endpoint"
LB = "envoy.lb"
SUBSET_NS = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"


def request(path: str, body: Mapping[str, object], headers: Mapping[str, str],
            subset: Iterable[str] | None = None) -> list[pb.ProcessingRequest]:
    """The request's headers then its whole body, with the subset hint in the filter
    metadata when given (the protocol's "Endpoint Subset")."""
    raw = orjson.dumps(body)
    hs = {":method": "POST", ":path": path, ":authority": "conformance",
          ":scheme": "http", "content-type": "application/json",
          "content-length": str(len(raw)), **headers}
    first = pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=pb.HeaderMap(
        headers=[pb.HeaderValue(key=k.lower(), raw_value=v.encode()) for k, v in hs.items()]),
        end_of_stream=False))
    if subset is not None:
        md = struct_pb2.Struct()
        md.update({SUBSET_KEY: list(subset)})
        first.metadata_context.filter_metadata[SUBSET_NS].CopyFrom(md)
    return [first, pb.ProcessingRequest(request_body=pb.HttpBody(body=raw,
                                                                 end_of_stream=True))]


def destination(resps: list[pb.ProcessingResponse]) -> tuple[str | None, str | None]:
    """(the header's value, the ``envoy.lb`` metadata's value) the EPP answered with."""
    header = meta = None
    for r in resps:
        if r.WhichOneof("response") == "request_headers":
            for o in r.request_headers.response.header_mutation.set_headers:
                if o.header.key.lower() == DESTINATION:
                    header = (o.header.raw_value.decode() if o.header.raw_value
                              else o.header.value)
        ns = r.dynamic_metadata.fields.get(LB)
        if ns is not None and DESTINATION in ns.struct_value.fields:
            meta = ns.struct_value.fields[DESTINATION].string_value
    return header, meta


def immediate_status(resps: list[pb.ProcessingResponse]) -> int | None:
    for r in resps:
        if r.WhichOneof("response") == "immediate_response":
            return int(r.immediate_response.status.code)
    return None
