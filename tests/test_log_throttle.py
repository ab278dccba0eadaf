"""Warnings an upstream causes per request are written once per cause and period."""

from __future__ import annotations

import logging

import pytest

from gateway.log_throttle import MAX_KEYS, Throttle

log = logging.getLogger("tokengate.test-throttle")


def test_one_line_per_cause_and_period_saying_how_many_were_held_back(
        caplog: pytest.LogCaptureFixture) -> None:
    now = [100.0]
    t = Throttle(60.0, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger=log.name):
        for i in range(50):
            t.warning(log, ("usage", "http://a"), "endpoint %s lied about %d", "http://a", i)
        t.warning(log, ("usage", "http://b"), "endpoint %s lied about %d", "http://b", 0)
        now[0] += 59.0
        t.warning(log, ("usage", "http://a"), "endpoint %s lied about %d", "http://a", 50)
        now[0] += 1.5
        t.warning(log, ("usage", "http://a"), "endpoint %s lied about %d", "http://a", 51)
        now[0] += 60.0
        t.warning(log, ("usage", "http://a"), "endpoint %s lied about %d", "http://a", 52)
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "endpoint http://a lied about 0",
        "endpoint http://b lied about 0",
        "endpoint http://a lied about 51 (and 50 more like it in the last 60 s)",
        "endpoint http://a lied about 52",
    ]


def test_the_causes_remembered_are_bounded(caplog: pytest.LogCaptureFixture) -> None:
    t = Throttle(60.0, clock=lambda: 0.0)
    with caplog.at_level(logging.WARNING, logger=log.name):
        for i in range(MAX_KEYS + 10):
            t.warning(log, i, "cause %d", i)
    assert len(caplog.records) == MAX_KEYS + 10  # every new cause is written
    assert len(t._last) <= MAX_KEYS
