"""Loopback ports for the programs this project starts (backends, gateways, Redis in tests)."""

from __future__ import annotations

import random
import socket

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


def free_port(*, bus: bool = False) -> int:
    """A port nothing listens on right now, below the ephemeral range (the caller binds it
    soon after); with ``bus``, its +10000 cluster-bus port is free too."""
    for _ in range(1000):
        port = random.randrange(LOW, HIGH)
        if _bindable(port) and (not bus or _bindable(port + 10000)):
            return port
    raise RuntimeError(f"no free port in {LOW}-{HIGH}")


# The client key of the demo stack (``tokengate up``'s policy), which the load harness uses.
DEMO_KEY = "tg-demo-key"
