"""Making a worker slower on purpose: a device marked `slowdown = k` in a cluster file
(`plait.cluster.Device`) is emulated by padding each of its ranks' steps with (k − 1) ×
the time the step spent computing (its forward and backward actions), so heterogeneous
plans (HetPipe, WSP) can be tried and measured on one machine of equal CPU cores.

The pad is a sleep, not repeated arithmetic: a slow device takes no compute from its
neighbours. Compute time is wall time, waits for peers excluded: on cores that the
workers share it includes waiting for a core, which a slower device would wait too.

Limits: the pad comes at the end of the rank's step rather than after each action, so in
a pipeline of several ranks the neighbours see the delay at the next step's first
message, not in the bubble of this one (exact for one-rank pipelines).

`EmulatedCompute` is the other way, for benchmarks on a machine with fewer cores than
workers: there every plan does the same arithmetic on the same shared cores, so no
re-balancing can shorten a step, whatever the devices are meant to be. Each block's
compute is a sleep (its real arithmetic, kept small, comes on top), taken after every
forward and at the start of every backward, so the workers act as independent devices
of the given speeds, action by action, and what is measured is the plan: its shares, its
pipeline, its waits and its reductions.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from torch import nn

from plait.cluster import Cluster

if TYPE_CHECKING:  # the launcher reads this module; the runtime (1.2 s to import) it never runs
    from plait.runtime.executor import ActionRecord

__all__ = ["EmulatedCompute", "compute_seconds", "pad_step", "rank_slowdowns"]

_COMPUTE = ("F", "B", "BI", "BW")
_LABEL = re.compile(r"^\d+([A-Z]+)\d+")  # stage, op, micro-batch (`plait.schedule.ir`)


def compute_seconds(records: Iterable[ActionRecord]) -> float:
    """Seconds a rank spent in forward and backward actions (labels such as `0F3`)."""
    total = 0.0
    for r in records:
        match = _LABEL.match(r.label)
        if match is not None and match.group(1) in _COMPUTE:
            total += r.end - r.start
    return total


def pad_step(records: Iterable[ActionRecord], slowdown: float,
             sleep: Callable[[float], None] = time.sleep) -> float:  # fmt: skip
    """Sleep (slowdown − 1) × the compute time of `records`; return the seconds slept."""
    if slowdown <= 1.0:
        return 0.0
    pad = (slowdown - 1.0) * compute_seconds(records)
    sleep(pad)
    return pad


class EmulatedCompute:
    """Every block of `model` sleeps `seconds` after its forward and twice that when its
    backward starts (a backward costs about two forwards, Narayanan et al. 2021), times
    `slowdown` while `slow` is set; `per_sample`: `seconds` is per sample of the block's
    input (its first dimension), so a device's time follows the share of the batch it
    gets."""

    def __init__(self, model: nn.Module, seconds: float, slowdown: float = 1.0, *,
                 per_sample: bool = False, slow: bool = False,
                 sleep: Callable[[float], None] = time.sleep) -> None:  # fmt: skip
        from plait.blocks import as_blocks

        if not seconds >= 0:
            raise ValueError(f"emulated compute of {seconds} s must be >= 0")
        if not slowdown >= 1:
            raise ValueError(f"slowdown={slowdown} must be >= 1 (2: half speed)")
        self.seconds, self.slowdown, self.per_sample = seconds, slowdown, per_sample
        self.slow, self._sleep = slow, sleep
        for block in as_blocks(model):
            block.register_forward_hook(self._forward)

    def _time(self, args: Any) -> float:
        samples = args[0].shape[0] if self.per_sample and args else 1
        return self.seconds * samples * (self.slowdown if self.slow else 1.0)

    def _forward(self, module: nn.Module, args: Any, output: Any) -> None:
        forward = self._time(args)
        self._sleep(forward)
        if getattr(output, "requires_grad", False):
            output.register_hook(lambda grad: self._sleep(2 * forward))


def rank_slowdowns(cluster: Cluster, world_size: int) -> tuple[float, ...]:
    """The slowdown of ranks 0 … world_size − 1: that of the cluster's device of the same
    rank. A cluster of fewer devices than workers is an error."""
    if cluster.num_devices < world_size:
        raise ValueError(
            f"cluster {cluster.name!r} has {cluster.num_devices} devices for {world_size} "
            "workers: give a cluster file with a device per worker, or fewer workers"
        )
    return tuple(float(cluster.device(r).slowdown) for r in range(world_size))
