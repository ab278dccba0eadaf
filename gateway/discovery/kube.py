"""An InferencePool's ready pods, followed with the official ``kubernetes`` client's list and
watch: the pool is read for its selector and ports, its pods are listed (the list's
``resourceVersion`` noted) and then watched from that version, with bookmarks, each window
``WATCH_S`` long; after each window the pool is read again (a changed selector or ports means
a fresh list). A watch the API server answers with ``410 Gone`` (the version is too old) is
followed by a fresh list; any other failure by a retry after a backoff, the last endpoints
kept meanwhile. The client is synchronous (urllib3): the watch runs in a thread of its own and
hands each new set of endpoints to ``on_change``."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import orjson

from gateway.config.discovery import Discovery
from gateway.discovery.pods import (
    PoolInvalid,
    PoolTarget,
    addresses,
    key,
    pool_target,
    resource_version,
)

log = logging.getLogger("tokengate.discovery")

GROUP, VERSION, PLURAL = "inference.networking.k8s.io", "v1", "inferencepools"
WATCH_S = 30  # one watch window (the API server ends it; the pool is read again after)
BACKOFF_S = (0.5, 1.0, 2.0, 5.0, 10.0)
SERVICE_ACCOUNT_NS = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")

Addresses = list[tuple[str, int, str]]  # (ip, port, role)


def own_namespace() -> str:
    """The namespace this pod runs in (its service account says), else ``default``."""
    try:
        return SERVICE_ACCOUNT_NS.read_text().strip() or "default"
    except OSError:
        return "default"


def api_client(kubeconfig: str | None) -> Any:
    """An API client: from ``kubeconfig``; else the pod's service account; else
    ``$KUBECONFIG`` (or ``~/.kube/config``)."""
    from kubernetes import client, config  # the extra tokengate[kubernetes]

    if kubeconfig:
        return config.new_client_from_config(config_file=kubeconfig)  # type: ignore[no-untyped-call]
    try:
        c = client.Configuration()
        config.load_incluster_config(client_configuration=c)  # type: ignore[no-untyped-call]
        return client.ApiClient(c)
    except config.ConfigException:
        return config.new_client_from_config()  # type: ignore[no-untyped-call]


class PoolWatcher:
    """Follows one InferencePool's pods; ``on_change`` gets every new set of ready
    ``(ip, port)`` (called from the watcher's thread)."""

    def __init__(self, d: Discovery, on_change: Callable[[Addresses], None],
                 watch_s: int = WATCH_S) -> None:
        self.d = d
        self.namespace = d.namespace or own_namespace()
        self.on_change = on_change
        self.watch_s = watch_s
        self.pods: dict[str, Mapping[str, Any]] = {}
        self.target: PoolTarget | None = None
        self.synced = threading.Event()  # the first list was read
        self.counts = {"lists": 0, "relists_gone": 0, "bookmarks": 0, "events": 0,
                       "errors": 0}
        self.last_error: str | None = None
        self._stop = threading.Event()
        self._watch: Any = None
        self._published: Addresses | None = None
        self._thread = threading.Thread(target=self._run, name=f"discovery-{d.name}",
                                        daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        w = self._watch
        if w is not None:
            w.stop()
        self._thread.join(5)

    # -- the loop ------------------------------------------------------------------------

    def _run(self) -> None:
        from kubernetes import client, watch
        from kubernetes.client.exceptions import ApiException

        failures = 0
        api = None
        while not self._stop.is_set():
            try:
                if api is None:
                    api = api_client(self.d.kubeconfig)
                core, custom = client.CoreV1Api(api), client.CustomObjectsApi(api)
                self._follow(core, custom, watch)
                failures = 0
            except ApiException as exc:
                if exc.status == 410:  # the version we watched from is gone: list again
                    self.counts["relists_gone"] += 1
                    continue
                api = None  # built anew from its configuration (a rotated token)
                failures = self._failed(f"the API server answered {exc.status}: "
                                        f"{exc.reason}", failures)
            except PoolInvalid as exc:
                failures = self._failed(str(exc), failures)
            except Exception as exc:  # the connection, the server's JSON: retried
                api = None
                failures = self._failed(f"{type(exc).__name__}: {exc}", failures)

    def _failed(self, why: str, failures: int) -> int:
        self.counts["errors"] += 1
        self.last_error = why
        log.warning("discovery of InferencePool %s/%s: %s (endpoints kept: %d)",
                    self.namespace, self.d.name, why, len(self._published or ()))
        self._stop.wait(BACKOFF_S[min(failures, len(BACKOFF_S) - 1)])
        return failures + 1

    def _pool(self, custom: Any) -> PoolTarget:
        pool = custom.get_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL,
                                                   self.d.name, _request_timeout=10)
        return pool_target(pool, self.d.port)

    def _follow(self, core: Any, custom: Any, watch: Any) -> None:
        """List, then watch window after window until the pool changes or a failure."""
        target = self.target = self._pool(custom)
        resp = core.list_namespaced_pod(self.namespace, label_selector=target.selector,
                                        _preload_content=False, _request_timeout=10)
        listed = orjson.loads(resp.data)
        self.counts["lists"] += 1
        self.pods = {key(p): p for p in listed.get("items") or ()}
        rv = resource_version(listed) or "0"
        self._publish()
        self.synced.set()

        def pods(*args: Any, **kwargs: Any) -> Any:  # untyped: the watch yields raw JSON
            return core.list_namespaced_pod(*args, **kwargs)

        while not self._stop.is_set():
            self._watch = watch.Watch()
            for ev in self._watch.stream(pods, self.namespace, label_selector=target.selector,
                                         resource_version=rv, allow_watch_bookmarks=True,
                                         timeout_seconds=self.watch_s,
                                         _request_timeout=self.watch_s + 10):
                obj = ev.get("raw_object") or ev.get("object") or {}
                rv = resource_version(obj) or rv
                kind = ev.get("type")
                if kind == "BOOKMARK":
                    self.counts["bookmarks"] += 1
                    continue
                self.counts["events"] += 1
                if kind in ("ADDED", "MODIFIED"):
                    self.pods[key(obj)] = obj
                elif kind == "DELETED":
                    self.pods.pop(key(obj), None)
                self._publish()
            self._watch = None
            if self._stop.is_set():
                return
            if self._pool(custom) != target:
                return  # the pool's selector or ports changed: list again

    def _publish(self) -> None:
        assert self.target is not None
        now = addresses(self.pods.values(), self.target.ports, self.d.role_label)
        if now != self._published:
            self._published = now
            self.on_change(now)
