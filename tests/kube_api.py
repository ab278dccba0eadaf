"""A stand-in for the Kubernetes API server, on loopback, for the discovery tests: no cluster
can run on the machines the tests run on, so this serves the part of the API server's real
HTTP protocol that list-and-watch clients use, and the official ``kubernetes`` client talks to
it through an ordinary kubeconfig:

- ``GET /apis/inference.networking.k8s.io/v1/namespaces/NS/inferencepools/NAME``;
- ``GET /api/v1/namespaces/NS/pods?labelSelector=…``: a ``PodList`` whose
  ``metadata.resourceVersion`` is the store's version;
- the same with ``watch=true&resourceVersion=RV``: one JSON event per line (``ADDED``,
  ``MODIFIED``, ``DELETED`` for every change after RV; a pod that stops or starts matching the
  selector is ``DELETED``/``ADDED``, as the API server sends it), ``BOOKMARK`` events carrying
  only a newer ``resourceVersion`` when ``allowWatchBookmarks`` is set, the stream ended after
  ``timeoutSeconds``; a version older than the compacted history answers one ``ERROR`` event
  with a ``Status`` of code 410 (``Expired``), as etcd compaction makes the real one do;
- a bearer token is required (401 ``Status`` otherwise).

What it does not do: other resources and verbs, field selectors, set-based label selectors,
pagination (``limit``/``continue``), protobuf, admission, RBAC beyond the token."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
from aiohttp import web
from threaded import ServerThread, start_server_thread

from protocol.loopback import free_port

TOKEN = "stand-in-token-for-tests"
BOOKMARK_S = 0.2


def status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": message, "reason": reason, "code": code}


def matches(labels: Mapping[str, str], selector: str) -> bool:
    """Equality-based label selectors (``a=b,c!=d``), as the API server reads them."""
    for term in filter(None, (t.strip() for t in selector.split(","))):
        if "!=" in term:
            k, v = term.split("!=", 1)
            if labels.get(k.strip()) == v.strip():
                return False
        else:
            k, v = term.replace("==", "=").split("=", 1)
            if labels.get(k.strip()) != v.strip():
                return False
    return True


def pod(name: str, ip: str, labels: Mapping[str, str], *, ready: bool = True,
        namespace: str = "llm") -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": namespace, "labels": dict(labels),
                         "uid": f"uid-{name}"},
            "spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai"}]},
            "status": {"phase": "Running", "podIP": ip,
                       "conditions": [{"type": "Ready", "status": "True" if ready
                                       else "False"}]}}


@dataclass
class Store:
    """Objects, their resource versions, and the pods' change history (for watches)."""

    version: int = 100
    pools: dict[str, dict[str, Any]] = field(default_factory=dict)
    pods: dict[str, dict[str, Any]] = field(default_factory=dict)
    history: list[tuple[int, dict[str, Any] | None, dict[str, Any] | None]] = field(
        default_factory=list)  # (version, before, after) of every pod change
    compacted: int = 0  # watches from a version below this are answered 410
    requests: list[tuple[str, dict[str, str]]] = field(default_factory=list)


class KubeAPI:
    """The stand-in, served from a thread; the test changes objects through its methods."""

    def __init__(self, namespace: str = "llm") -> None:
        self.namespace = namespace
        self.store = Store()
        self.lock = threading.Lock()
        self.changed: asyncio.Event | None = None
        self.cut = 0  # watches opened before a cut are ended (a dropped connection)
        self.port = free_port()
        self.server: ServerThread = start_server_thread(self._serve, "kube-api")

    # -- what tests change ----------------------------------------------------------------

    def set_pool(self, name: str, labels: Mapping[str, str], ports: list[int]) -> None:
        with self.lock:
            self.store.version += 1
            self.store.pools[name] = {
                "apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
                "metadata": {"name": name, "namespace": self.namespace,
                             "resourceVersion": str(self.store.version)},
                "spec": {"selector": {"matchLabels": dict(labels)},
                         "targetPorts": [{"number": p} for p in ports],
                         "endpointPickerRef": {"name": "tokengate-epp",
                                               "port": {"number": 9002}}}}
        self._wake()

    def put_pod(self, obj: dict[str, Any]) -> None:
        """Create or replace a pod (``kubectl apply``; a kubelet's status update)."""
        with self.lock:
            self.store.version += 1
            obj = copy.deepcopy(obj)
            obj["metadata"]["resourceVersion"] = str(self.store.version)
            name = obj["metadata"]["name"]
            before = self.store.pods.get(name)
            self.store.pods[name] = obj
            self.store.history.append((self.store.version, before, obj))
        self._wake()

    def set_ready(self, name: str, ready: bool) -> None:
        with self.lock:
            obj = copy.deepcopy(self.store.pods[name])
        obj["status"]["conditions"] = [{"type": "Ready", "status": "True" if ready else "False"}]
        self.put_pod(obj)

    def delete_pod(self, name: str) -> None:
        with self.lock:
            self.store.version += 1
            before = self.store.pods.pop(name)
            self.store.history.append((self.store.version, before, None))
        self._wake()

    def compact(self) -> None:
        """Forget the history so far (etcd's compaction): older watches get 410 Gone."""
        with self.lock:
            self.store.compacted = self.store.version + 1
            self.store.history.clear()

    def drop_watches(self) -> None:
        """End every open watch (the API server restarted, or a load balancer cut them)."""
        with self.lock:
            self.cut += 1
        self._wake()

    def requests(self, path_part: str) -> list[dict[str, str]]:
        with self.lock:
            return [q for p, q in self.store.requests if path_part in p]

    def kubeconfig(self, path: Path, token: str = TOKEN) -> Path:
        path.write_text(f"""apiVersion: v1
kind: Config
clusters:
- name: stand-in
  cluster: {{server: "http://127.0.0.1:{self.port}"}}
users:
- name: tokengate
  user: {{token: {token}}}
contexts:
- name: stand-in
  context: {{cluster: stand-in, user: tokengate, namespace: {self.namespace}}}
current-context: stand-in
""")
        return path

    def close(self) -> None:
        self.server.close()

    # -- the server -----------------------------------------------------------------------

    def _wake(self) -> None:
        loop = self.server.loop if hasattr(self, "server") else None
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._notify)

    def _notify(self) -> None:
        if self.changed is not None:
            self.changed.set()
        self.changed = asyncio.Event()

    async def _serve(self, ready: asyncio.Event, stop: asyncio.Event) -> None:
        self.changed = asyncio.Event()
        app = web.Application(middlewares=[self._auth])
        app.router.add_get("/apis/inference.networking.k8s.io/v1/namespaces/{ns}/"
                           "inferencepools/{name}", self._get_pool)
        app.router.add_get("/api/v1/namespaces/{ns}/pods", self._pods)
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", self.port).start()
        ready.set()
        await stop.wait()
        await runner.cleanup()

    @web.middleware
    async def _auth(self, request: web.Request, handler: Any) -> web.StreamResponse:
        with self.lock:
            self.store.requests.append((request.path, dict(request.query)))
        if request.headers.get("Authorization") != f"Bearer {TOKEN}":
            return web.json_response(status(401, "Unauthorized", "Unauthorized"), status=401)
        resp: web.StreamResponse = await handler(request)
        return resp

    async def _get_pool(self, request: web.Request) -> web.Response:
        with self.lock:
            obj = self.store.pools.get(request.match_info["name"])
        if obj is None or request.match_info["ns"] != self.namespace:
            name = request.match_info["name"]
            return web.json_response(status(404, "NotFound", f'inferencepools.inference.'
                                            f'networking.k8s.io "{name}" not found'),
                                     status=404)
        return web.json_response(obj)

    async def _pods(self, request: web.Request) -> web.StreamResponse:
        q = request.query
        selector = q.get("labelSelector", "")
        if q.get("watch") in ("true", "1"):
            return await self._watch(request, selector)
        with self.lock:
            items = [copy.deepcopy(p) for p in self.store.pods.values()
                     if request.match_info["ns"] == self.namespace
                     and matches(p["metadata"].get("labels", {}), selector)]
            version = self.store.version
        return web.json_response({"kind": "PodList", "apiVersion": "v1",
                                  "metadata": {"resourceVersion": str(version)},
                                  "items": items})

    async def _watch(self, request: web.Request, selector: str) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        with contextlib.suppress(ConnectionError):  # the client went away
            await self._stream(request, selector, resp)
        return resp

    async def _stream(self, request: web.Request, selector: str, resp: web.StreamResponse
                      ) -> None:
        q = request.query
        since = int(q.get("resourceVersion") or 0)
        bookmarks = q.get("allowWatchBookmarks") in ("true", "1")
        timeout = float(q.get("timeoutSeconds") or 300)
        await resp.prepare(request)
        with self.lock:
            gone = since < self.store.compacted
            cut = self.cut
        if gone:
            await resp.write(orjson.dumps({"type": "ERROR", "object": status(
                410, "Expired", f"too old resource version: {since} "
                f"({self.store.compacted})")}) + b"\n")
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        next_bookmark = loop.time() + BOOKMARK_S
        while loop.time() < deadline:
            with self.lock:
                if self.cut != cut:
                    break  # the connection is dropped without a word
                changes = [(v, b, a) for v, b, a in self.store.history if v > since]
                version = self.store.version
            for v, before, after in changes:
                ev = self._event(before, after, selector, v)
                if ev is not None:
                    await resp.write(orjson.dumps(ev) + b"\n")
                since = v
            if bookmarks and loop.time() >= next_bookmark:
                since = max(since, version)
                await resp.write(orjson.dumps({"type": "BOOKMARK", "object": {
                    "kind": "Pod", "apiVersion": "v1",
                    "metadata": {"resourceVersion": str(since)}}}) + b"\n")
                next_bookmark = loop.time() + BOOKMARK_S
            changed = self.changed
            assert changed is not None
            wait = max(0.0, min(deadline, next_bookmark) - loop.time())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), wait)

    @staticmethod
    def _event(before: dict[str, Any] | None, after: dict[str, Any] | None, selector: str,
               version: int) -> dict[str, Any] | None:
        was = before is not None and matches(before["metadata"].get("labels", {}), selector)
        now = after is not None and matches(after["metadata"].get("labels", {}), selector)
        if now and after is not None:
            return {"type": "MODIFIED" if was else "ADDED", "object": after}
        if was and before is not None:
            gone = copy.deepcopy(after if after is not None else before)
            gone["metadata"]["resourceVersion"] = str(version)
            return {"type": "DELETED", "object": gone}
        return None
