"""Loopback ports for the programs this project starts (backends, gateways, Redis in tests)."""

from __future__ import annotations

import random
import socket
import threading
from collections import deque

# Linux hands out ephemeral ports from 32768 up: a port chosen there can be taken by an
# outgoing connection before its server binds it, or connect to itself while polled (TCP
# self-connect). Ports are chosen below it, and below 55535 so a Redis Cluster bus port
# (+10000) fits too.
LOW, HIGH = 12000, 22700


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


# The ports handed out lately: one chosen but not yet bound looks free, so without this two
# calls in a row (a publisher's port and its replay port) could return the same one.
RECENT = 2048
_handed: deque[int] = deque(maxlen=RECENT)
_lock = threading.Lock()


def free_port(*, bus: bool = False) -> int:
    """A port nothing listens on right now, below the ephemeral range (the caller binds it
    soon after), and none of the last ``RECENT`` this process was given; with ``bus``, its
    +10000 cluster-bus port is free too."""
    with _lock:
        for _ in range(1000):
            port = random.randrange(LOW, HIGH)
            if port in _handed or (bus and port + 10000 in _handed):
                continue
            if _bindable(port) and (not bus or _bindable(port + 10000)):
                _handed.append(port)
                if bus:
                    _handed.append(port + 10000)
                return port
    raise RuntimeError(f"no free port in {LOW}-{HIGH}")


# The client key of the demo stack (``tokengate up``'s policy), which the load harness uses.
DEMO_KEY = "tg-demo-key"
