"""Envoy's ext_proc gRPC service, ``envoy.service.ext_proc.v3.ExternalProcessor/Process``,
over the messages of ``gateway/epp/proto/ext_proc.proto``.

That file declares the ext_proc v3 messages field for field (numbers and types as in Envoy's
``external_processor.proto`` and the ``config.core``, ``type`` and ``ext_proc`` filter
messages it uses), in a package of its own so that it never meets Envoy's generated modules
in one descriptor pool; the wire carries field numbers, not names, and the service keeps
Envoy's name. Its Python module is generated when the package is built (``setup.py``)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

import grpc

from gateway.epp.proto import ext_proc_pb2 as pb

SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
PROCESS = f"/{SERVICE}/Process"

Process = Callable[[AsyncIterator[pb.ProcessingRequest], grpc.aio.ServicerContext[
    pb.ProcessingRequest, pb.ProcessingResponse]], AsyncIterator[pb.ProcessingResponse]]


def handler(process: Process) -> grpc.GenericRpcHandler:
    """The service, answered by ``process`` (one call per HTTP request Envoy proxies)."""
    return grpc.method_handlers_generic_handler(SERVICE, {
        "Process": grpc.stream_stream_rpc_method_handler(
            process, request_deserializer=pb.ProcessingRequest.FromString,
            response_serializer=pb.ProcessingResponse.SerializeToString)})


def client(channel: grpc.Channel
           ) -> grpc.StreamStreamMultiCallable[pb.ProcessingRequest, pb.ProcessingResponse]:
    """A caller of ``Process`` on ``channel``, as Envoy calls it."""
    return channel.stream_stream(PROCESS,
                                 request_serializer=pb.ProcessingRequest.SerializeToString,
                                 response_deserializer=pb.ProcessingResponse.FromString)
