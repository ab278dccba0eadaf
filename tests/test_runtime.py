"""``protocol.runtime``: what every program does to its process after startup."""

from __future__ import annotations

import gc
import warnings
import weakref

from protocol.runtime import freeze_startup_heap


class Node:
    def __init__(self) -> None:
        self.other: Node | None = None


def test_the_startup_heap_is_frozen_after_its_garbage_is_collected() -> None:
    with warnings.catch_warnings():  # other tests' garbage first (a leaked socket warns)
        warnings.simplefilter("ignore", ResourceWarning)
        gc.collect()
    a, b = Node(), Node()
    a.other, b.other = b, a  # a cycle: only the collector frees it
    gone = weakref.ref(a)
    del a, b
    kept = Node()
    try:
        frozen = freeze_startup_heap()
        assert gone() is None  # collected first, not frozen for ever
        assert frozen == gc.get_freeze_count() > 0
        assert all(o is not kept for o in gc.get_objects())  # out of the collector's walk
        # what is made after startup is still collected
        c, d = Node(), Node()
        c.other, d.other = d, c
        later = weakref.ref(c)
        del c, d
        gc.collect()
        assert later() is None
    finally:
        gc.unfreeze()
