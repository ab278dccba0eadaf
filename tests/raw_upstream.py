"""A raw-socket upstream on loopback for tests: it reads each HTTP request and answers with
whatever bytes the test scripts, well-formed or not (a bad status line, a huge head, a bad
chunk, an interim 100, a close mid-stream, a stall, a TLS listener...).

``script(request) -> Answer`` is called per request, from the upstream's own thread; an answer
is a list of steps: ``bytes`` are written, a ``float`` sleeps that long, ``WAIT`` parks until
the test calls ``release()`` (or the client goes away), ``CLOSE`` closes the connection."""

from __future__ import annotations

import asyncio
import contextlib
import json
import ssl
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from threaded import ServerThread, start_server_thread

WAIT = object()
CLOSE = object()
Step = bytes | float | object
Answer = list[Step]


@dataclass
class Request:
    head: bytes
    body: bytes

    @property
    def json(self) -> dict[str, Any]:
        obj = json.loads(self.body)
        assert isinstance(obj, dict)
        return obj

    def header(self, name: str) -> str | None:
        for line in self.head.split(b"\r\n")[1:]:
            k, _, v = line.partition(b":")
            if k.strip().lower() == name.lower().encode():
                return v.strip().decode("latin-1")
        return None


@dataclass
class RawUpstream:
    script: Callable[[Request], Answer]
    tls: ssl.SSLContext | None = None
    # answers the gateway's scrapes and probes (GETs) when set; else they get a 404
    scrapes: Callable[[Request], Answer] | None = None
    requests: list[Request] = field(default_factory=list)
    port: int = 0
    server: ServerThread | None = None
    _gate: asyncio.Event | None = None
    released: threading.Event = field(default_factory=threading.Event)
    connections: int = 0  # connections that carried a POST (the gateway's scrapes aside)
    closed: int = 0  # of those, how many have closed (either side)
    _writers: set[asyncio.StreamWriter] = field(default_factory=set)

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.port}/v1"

    def start(self) -> RawUpstream:
        async def serve(ready: asyncio.Event, stop: asyncio.Event) -> None:
            self._gate = asyncio.Event()
            srv = await asyncio.start_server(self._conn, "127.0.0.1", 0, ssl=self.tls)
            self.port = srv.sockets[0].getsockname()[1]
            ready.set()
            await stop.wait()
            srv.close()
            self._gate.set()
            for w in list(self._writers):  # parked answers end now, their sockets closed
                w.close()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(srv.wait_closed(), 5)
            while self._writers:  # noqa: ASYNC110 - the handlers finish (each closes its writer)
                await asyncio.sleep(0.01)

        self.server = start_server_thread(serve, "raw-upstream")
        return self

    def release(self) -> None:
        """Let every answer parked at ``WAIT`` go on."""
        assert self.server is not None and self._gate is not None
        self.server.loop.call_soon_threadsafe(self._gate.set)

    def close(self) -> None:
        if self.server is not None:
            self.server.close()

    async def _conn(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        posted = False
        self._writers.add(writer)
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                req = Request(head, b"")
                n = int(req.header("content-length") or 0)
                req.body = await reader.readexactly(n) if n else b""
                if not req.head.startswith(b"POST "):  # the gateway's scrapes and probes
                    if self.scrapes is None:
                        writer.write(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")
                    elif not await self._play(self.scrapes(req), reader, writer):
                        return
                    continue
                self.requests.append(req)
                if not posted:
                    posted = True
                    self.connections += 1
                if not await self._play(self.script(req), reader, writer):
                    return
        except (ConnectionError, asyncio.IncompleteReadError, ssl.SSLError):
            return
        finally:
            with contextlib.suppress(Exception):
                writer.close()
                await writer.wait_closed()
            self._writers.discard(writer)
            self.closed += posted

    async def _play(self, answer: Answer, reader: asyncio.StreamReader,
                    writer: asyncio.StreamWriter) -> bool:
        """Play one answer; False when the connection is to be closed."""
        assert self._gate is not None
        for step in answer:
            if step is CLOSE:
                return False
            if step is WAIT:
                gone = asyncio.ensure_future(reader.read(1))  # the client closing ends it
                gate = asyncio.ensure_future(self._gate.wait())
                await asyncio.wait([gone, gate], return_when=asyncio.FIRST_COMPLETED)
                ended = gone.done()
                for t in (gone, gate):
                    t.cancel()
                    with contextlib.suppress(asyncio.CancelledError, ConnectionError):
                        await t
                if ended:
                    return False
                continue
            if isinstance(step, float):
                await asyncio.sleep(step)
                continue
            assert isinstance(step, bytes)
            writer.write(step)
            await writer.drain()
        return True


# -- well-formed pieces ----------------------------------------------------------------------

def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def sse(obj: dict[str, Any] | str, *, spaced: bool = False) -> bytes:
    text = obj if isinstance(obj, str) else json.dumps(
        obj, separators=(", ", ": ") if spaced else (",", ":"))
    return f"data: {text}\n\n".encode()


STREAM_HEAD = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
               b"Transfer-Encoding: chunked\r\n\r\n")


def delta(i: int, kind: str = "chat", model: str = "up", *, spaced: bool = False,
          what: str = "content") -> bytes:
    if kind == "chat":
        d: dict[str, Any]
        if what == "tool":
            d = {"tool_calls": [{"index": 0, "function": {"arguments": f"a{i}"}}]}
        elif what == "reasoning":
            d = {"reasoning_content": f"r{i}"}
        else:
            d = {"content": f"t{i}"}
        choice: dict[str, Any] = {"index": 0, "delta": d, "finish_reason": None}
        obj = {"id": "c1", "object": "chat.completion.chunk", "model": model,
               "choices": [choice]}
    else:
        obj = {"id": "c1", "object": "text_completion", "model": model,
               "choices": [{"index": 0, "text": f"t{i}", "finish_reason": None}]}
    return chunk(sse(obj, spaced=spaced))


def usage_event(prompt: int, completion: int, model: str = "up", *,
                spaced: bool = False) -> bytes:
    return chunk(sse({"id": "c1", "object": "chat.completion.chunk", "model": model,
                      "choices": [], "usage": {"prompt_tokens": prompt,
                                               "completion_tokens": completion,
                                               "total_tokens": prompt + completion}},
                     spaced=spaced))


DONE = chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n"


def json_response(status: int, obj: dict[str, Any], reason: str = "OK") -> bytes:
    body = json.dumps(obj).encode()
    return (f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


def completion(kind: str, text: str, prompt: int | None, completion_tokens: int | None,
               model: str = "up") -> dict[str, Any]:
    choice: dict[str, Any] = ({"index": 0, "message": {"role": "assistant", "content": text},
                               "finish_reason": "stop"} if kind == "chat" else
                              {"index": 0, "text": text, "finish_reason": "stop"})
    obj: dict[str, Any] = {"id": "c1", "object": "chat.completion" if kind == "chat"
                           else "text_completion", "model": model, "choices": [choice]}
    if prompt is not None and completion_tokens is not None:
        obj["usage"] = {"prompt_tokens": prompt, "completion_tokens": completion_tokens,
                        "total_tokens": prompt + completion_tokens}
    return obj
