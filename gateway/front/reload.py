"""Policy hot reload: when the file changes (polled) or on SIGHUP.

A valid new policy replaces the old one for new requests; requests in flight finish on the
version they started with. An invalid one is refused: the old policy keeps serving, the refusal
is logged with the loader's message (file, path, reason) and counted in
``tokengate_policy_reloads_total{outcome="rejected"}``.
"""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path

from gateway.config.policy import PolicyError, load_policy
from gateway.state import GatewayState, build_view, sync_tracer

log = logging.getLogger("tokengate.gateway")


class PolicyWatcher:
    def __init__(self, path: str | Path, state: GatewayState, interval_s: float = 1.0) -> None:
        self.path = Path(path)
        self.state = state
        self.interval_s = interval_s
        self._mtime = self._stat()
        self.last_error: str | None = None

    def _stat(self) -> float | None:
        try:
            return os.stat(self.path).st_mtime_ns / 1e9
        except OSError:
            return None

    def reload(self) -> bool:
        """Load the file now; True if the new policy took effect."""
        self._mtime = self._stat()
        try:
            policy = load_policy(self.path)
            view = build_view(policy, self.state.tokenizers, self.state.executor,
                              self.state.fleet, self.state.predictor, self.state.view,
                              self.state.scalers, self.state.found)
        except (PolicyError, ValueError) as exc:
            self.last_error = str(exc)
            self.state.metrics.policy_reloads.labels("rejected").inc()
            log.error("policy reload refused, keeping the current policy: %s", exc)
            return False
        self.state.view = view
        sync_tracer(self.state)
        self.last_error = None
        self.state.metrics.policy_reloads.labels("applied").inc()
        log.info("policy reloaded from %s", self.path)
        return True

    async def run(self) -> None:
        """Poll the file; a reload that fails unexpectedly (not a refused policy: a bug, or
        the tokenizer failing to load) is logged with its traceback, counted as ``error``,
        and the watcher keeps polling with the old policy in force."""
        while True:
            await asyncio.sleep(self.interval_s)
            if self._stat() != self._mtime:
                try:
                    self.reload()
                except Exception as exc:
                    log.exception("policy reload failed, keeping the current policy")
                    self.last_error = f"{type(exc).__name__}: {exc}"
                    self.state.metrics.policy_reloads.labels("error").inc()
