"""Ports the programs choose (``protocol.loopback``): below Linux's ephemeral range, where an
outgoing connection cannot take one before its server binds it (nor connect to itself)."""

from __future__ import annotations

import socket
from pathlib import Path

from protocol.loopback import HIGH, RECENT, free_port
from protocol.loopback import _bindable as bindable


def test_free_ports_lie_below_the_ephemeral_range_and_are_free() -> None:
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    assert low >= HIGH
    for _ in range(50):
        port = free_port()
        assert port < low and bindable(port)
        bus = free_port(bus=True)
        assert bus + 10000 < 65536 and bindable(bus + 10000)


def test_a_port_in_use_is_not_offered() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        taken = s.getsockname()[1]
        assert not bindable(taken)


def test_a_port_is_not_handed_out_twice_before_it_is_bound() -> None:
    """Ports chosen in a row (a publisher's and its replay port) differ even though neither
    is bound yet: random draws from the range would repeat within a few hundred."""
    ports = [free_port() for _ in range(RECENT // 2)] + [free_port(bus=True) for _ in range(10)]
    assert len(set(ports)) == len(ports)
