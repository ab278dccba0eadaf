"""What Envoy's ext_proc protocol costs an EPP in Python before it does any work: the floor
under ``tokengate epp``'s CPU per request.

    python -m benchmarks.ext_proc_floor [--streams 4000] [--rounds 3] [--concurrency 4]
        [--out DIR]

A ``grpc.aio`` server on uvloop in a process of its own (as ``tokengate epp`` runs) serves
``envoy.service.ext_proc.v3.ExternalProcessor/Process`` with a handler that does nothing but
answer: one stream per request carrying what Envoy sends for a small non-streamed chat in
``FULL_DUPLEX_STREAMED`` mode (request headers, a body chunk, the empty end of the body,
response headers, two body chunks, the end; 7 messages) and the 4 answers the EPP gives.
A ``grpc.aio`` client in this process keeps ``--concurrency`` streams open at a time. The
server's CPU time over the run, per stream, is the transport's own cost per request; compare
it with ``tokengate serve``'s whole CPU per request in ``make bench-path`` (same machine, same
hour).

    python -m benchmarks.ext_proc_floor --serve-relay PORT

runs the least an endpoint picker behind real Envoy can do (``benchmarks.envoy``'s
``envoy+floor``): it keeps each side's body until its end, as a picker that routes on the
request and rebuilds the answer must, then gives it back unchanged with empty header answers
(Envoy's own load balancing picks the endpoint), and answers gRPC health checks.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc

from benchmarks import common
from benchmarks.proxy import cpu_seconds
from gateway.epp import messages
from gateway.epp.proto import ext_proc_pb2 as pb
from gateway.epp.service import PROCESS, handler
from protocol.loopback import free_port


def sent() -> list[pb.ProcessingRequest]:
    """What Envoy sends for one small non-streamed chat, in order."""
    return [pb.ProcessingRequest(request_headers=pb.HttpHeaders(end_of_stream=False)),
            pb.ProcessingRequest(request_body=pb.HttpBody(body=b"x" * 80)),
            pb.ProcessingRequest(request_body=pb.HttpBody(end_of_stream=True)),
            pb.ProcessingRequest(response_headers=pb.HttpHeaders(end_of_stream=False)),
            pb.ProcessingRequest(response_body=pb.HttpBody(body=b"y" * 700)),
            pb.ProcessingRequest(response_body=pb.HttpBody(body=b"y" * 700)),
            pb.ProcessingRequest(response_body=pb.HttpBody(end_of_stream=True))]


def answers(req: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
    """The EPP's answers: headers and body once each side's body ended, nothing before."""
    if req.WhichOneof("request") == "request_body" and req.request_body.end_of_stream:
        return [pb.ProcessingResponse(request_headers=pb.HeadersResponse()),
                pb.ProcessingResponse(request_body=pb.BodyResponse())]
    if req.WhichOneof("request") == "response_body" and req.response_body.end_of_stream:
        return [pb.ProcessingResponse(response_headers=pb.HeadersResponse()),
                pb.ProcessingResponse(response_body=pb.BodyResponse())]
    return []


async def process(requests: AsyncIterator[pb.ProcessingRequest], context: Any
                  ) -> AsyncIterator[pb.ProcessingResponse]:
    async for req in requests:
        for resp in answers(req):
            yield resp


async def relay(requests: AsyncIterator[pb.ProcessingRequest], context: Any
                ) -> AsyncIterator[pb.ProcessingResponse]:
    """Each side's body back unchanged at its end, after an empty header answer: the
    ``FULL_DUPLEX_STREAMED`` exchange with no work in it."""
    held = {"request_body": bytearray(), "response_body": bytearray()}
    async for req in requests:
        kind = req.WhichOneof("request")
        if kind in held:
            part: pb.HttpBody = getattr(req, kind)
            held[kind] += part.body
            if part.end_of_stream:
                response = kind == "response_body"
                yield (pb.ProcessingResponse(response_headers=pb.HeadersResponse()) if response
                       else pb.ProcessingResponse(request_headers=pb.HeadersResponse()))
                for answer in messages.body(bytes(held[kind]), True, response=response):
                    yield answer
        elif kind in ("request_trailers", "response_trailers"):
            yield messages.trailers(response=kind == "response_trailers")


def serve_relay(port: int) -> None:
    """``relay`` on ``port`` until killed, with gRPC health checks answered SERVING."""
    from grpc_health.v1 import health, health_pb2_grpc

    from protocol.runtime import run_loop

    async def main() -> None:
        server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        server.add_generic_rpc_handlers((handler(relay),))
        health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        await server.wait_for_termination()

    run_loop(main())


def _serve(port: int, ready: Any) -> None:
    from protocol.runtime import run_loop

    async def main() -> None:
        server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        server.add_generic_rpc_handlers((handler(process),))
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        ready.set()
        await server.wait_for_termination()

    run_loop(main())


async def drive(port: int, streams: int, concurrency: int) -> float:
    """Run ``streams`` exchanges, ``concurrency`` at a time: the seconds it took."""
    msgs = sent()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        call = ch.stream_stream(PROCESS,
                                request_serializer=pb.ProcessingRequest.SerializeToString,
                                response_deserializer=pb.ProcessingResponse.FromString)
        gate = asyncio.Semaphore(concurrency)

        async def one() -> None:
            async with gate:
                c = call()
                for m in msgs[:3]:
                    await c.write(m)
                await c.read()
                await c.read()
                for m in msgs[3:]:
                    await c.write(m)
                await c.read()
                await c.read()
                await c.done_writing()

        t = time.perf_counter()
        await asyncio.gather(*(one() for _ in range(streams)))
        return time.perf_counter() - t


def main() -> None:
    p = common.parser(__doc__, "ext-proc-floor")
    p.add_argument("--streams", type=int, default=4000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--serve-relay", type=int, metavar="PORT",
                   help="only run the relaying picker on PORT (for benchmarks.envoy)")
    args = p.parse_args()
    if args.serve_relay:
        serve_relay(args.serve_relay)
        return
    port = free_port()
    ctx = multiprocessing.get_context("spawn")
    ready = ctx.Event()
    server = ctx.Process(target=_serve, args=(port, ready), daemon=True)
    server.start()
    rounds: list[dict[str, float]] = []
    try:
        if not ready.wait(60):
            raise SystemExit("the gRPC server did not start")
        asyncio.run(drive(port, 200, args.concurrency))  # warm-up
        for r in range(args.rounds):
            assert server.pid is not None
            c0 = cpu_seconds(server.pid)
            took = asyncio.run(drive(port, args.streams, args.concurrency))
            cpu = cpu_seconds(server.pid) - c0
            rounds.append({"server_cpu_us_per_stream": cpu / args.streams * 1e6,
                           "streams_per_s": args.streams / took})
            print(f"round {r + 1}: {rounds[-1]['server_cpu_us_per_stream']:.0f} µs of the "
                  f"server's CPU per stream, {rounds[-1]['streams_per_s']:.0f} streams/s",
                  flush=True)
    finally:
        server.terminate()
        server.join(10)
    common.write(args.out, {"when": common.when(), "streams": args.streams,
                            "concurrency": args.concurrency, "rounds": rounds})


if __name__ == "__main__":
    main()
