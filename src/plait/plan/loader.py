"""The input pipeline's bound on a plan's step: no step is shorter than loading its batch.

Each data-parallel replica's first pipeline stage loads that replica's batch (micro-batch
size × micro-batches samples) in one loading process, at a rate of samples per second per
process; the stages after it receive activations, not samples. A prefetching loader (a
PyTorch `DataLoader` with workers) prepares the next batch while the devices compute this
one, so the two overlap and a step takes max(simulated step, batch / rate). More replicas
mean more loading processes, each with a smaller share: data parallelism divides the
loading time, pipeline parallelism does not.
Limits: loading is assumed to scale with the replicas (a host with cores to spare for every
loader) and to cost the devices nothing; a host whose cores the loaders share, input
decoded on the device, and the first step's unhidden load are not modelled.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar, Protocol, TypeVar

from plait.plan.hetero import HeteroPlan
from plait.sim import SimPlan

__all__ = ["Ranked", "check_rate", "replica_batch", "with_loader"]


class Ranked(Protocol):
    """What `with_loader` reads of a ranked plan (`plait.plan.search.RankedPlan`, a
    dataclass), typed here so that the search may import this module and not the reverse."""

    __dataclass_fields__: ClassVar[dict[str, Any]]

    @property
    def plan(self) -> SimPlan: ...

    @property
    def hetero(self) -> HeteroPlan | None: ...

    @property
    def simulated_step_s(self) -> float: ...

    @property
    def mfu(self) -> float: ...

    @property
    def tokens_per_s(self) -> float: ...


R = TypeVar("R", bound=Ranked)


def check_rate(rate: float | None, name: str) -> float | None:
    """`rate` (samples per second per loading process) if it is one; None and 0 mean the
    input pipeline is not modelled. `name` is the setting the error names."""
    if rate is not None and not (rate >= 0 and math.isfinite(rate)):
        raise ValueError(
            f"{name}={rate} must be a finite number of samples per second >= 0 "
            "(0 or unset: the input pipeline is not modelled)"
        )
    return rate or None


def replica_batch(plan: SimPlan, hetero: HeteroPlan | None = None) -> int:
    """Samples the largest data-parallel replica takes per step (its first stage loads them)."""
    microbatches = plan.microbatches
    if hetero is not None:  # unequal devices: each pipeline has its own share
        microbatches = max(r.num_microbatches for r in hetero.replicas)
    return plan.micro_batch_size * microbatches


def with_loader(ranked: R, rate: float | None) -> R:
    """`ranked` with its input loaded at `rate` samples per second per process: its step the
    longer of the simulated step and the load, its throughput and MFU over that step;
    unchanged when `rate` is None (or 0)."""
    if not rate:
        return ranked
    loader = replica_batch(ranked.plan, ranked.hetero) / rate
    simulated = ranked.simulated_step_s
    step = max(simulated, loader)
    return dataclasses.replace(
        ranked,
        step_time_s=step,
        mfu=ranked.mfu * simulated / step,
        tokens_per_s=ranked.tokens_per_s * simulated / step,
        loader_step_s=loader,
    )
