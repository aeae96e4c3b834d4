"""Two adjustments to torch's elastic agent for plait's local launch (`plait.train.launch`),
each a patch of one torch method for the launch's duration, because torch offers no
setting for either; without the method (another torch release) each does nothing.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["cheap_rendezvous_names", "stopped_workers_end"]


@contextlib.contextmanager
def _replaced(owner: Any, name: str, make: Callable[[Any], Any]) -> Iterator[None]:
    """`owner.name` replaced by `make(original)` inside the block; nothing when torch has
    no such attribute."""
    original = getattr(owner, name, None)
    if original is None:
        yield
        return
    setattr(owner, name, make(original))
    try:
        yield
    finally:
        setattr(owner, name, original)


def stopped_workers_end() -> contextlib.AbstractContextManager[None]:
    """Continue (SIGCONT) the workers torch is ending after one failed: a stopped worker
    (SIGSTOP, a debugger) holds torch's SIGTERM pending, and torch waits 30 s for it before
    SIGKILL, so a run whose peer timed out on a stopped rank reported it half a minute late.
    torch sends SIGTERM and then joins with a timeout (`ProcessContext.join`); the
    continue goes in that join."""
    from torch.multiprocessing.spawn import ProcessContext

    if not hasattr(signal, "SIGCONT"):
        return contextlib.nullcontext()

    def make(original: Callable[[Any, float], None]) -> Callable[[Any, float], None]:
        def join(self: Any, timeout: float) -> None:
            for proc in self.processes:
                if proc.is_alive():
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(proc.pid, signal.SIGCONT)
            original(self, timeout)

        return join

    return _replaced(ProcessContext, "_join_procs_with_timeout", make)


def cheap_rendezvous_names() -> contextlib.AbstractContextManager[None]:
    """The dynamic rendezvous names the calling method in its log records by
    `inspect.stack()`, which reads the source of every frame: 18 calls took 1.0 s of the
    launcher's CPU while its workers started on the same cores. The frame's own code
    names it as well."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    def get_method_name(depth: int = 2) -> str:
        try:
            return sys._getframe(depth).f_code.co_name
        except ValueError:
            return "no_method_name"

    return _replaced(dynamic_rendezvous, "get_method_name", lambda _: get_method_name)
