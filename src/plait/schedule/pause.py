"""Pausing the cyclic garbage collector while a large structure without cycles is built.

A replay or a lowered schedule of a long pipeline allocates hundreds of thousands of
actions and times, none in a reference cycle, yet each allocation burst starts collections
that walk every live object (a planner holds tens of thousands of plans): a third of a
large replay's time went to them.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["gc_paused"]


@contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic collector for the block (reference counting still frees what
    the block drops), then restore it as it was."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
