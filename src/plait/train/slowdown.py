"""`plait train --cluster FILE`: each worker runs as slow as its device in the cluster file.

Rank r is the cluster's device r (the planner numbers devices the same way, so a plan
made for the file puts its slow pipelines where training slows them). A device marked
`slowdown = k` pads each of the rank's steps with (k − 1) × the seconds the step spent in
its forward and backward actions (`plait.runtime.slowdown.pad_step`). The pad is per step,
not per action: in a pipeline of several ranks the neighbours meet the delay at the next
step's first message rather than inside this step's bubble; a one-rank pipeline (WSP's
and data parallelism's usual case) sees it exactly.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from plait.cluster import Cluster, load_cluster
from plait.runtime.slowdown import pad_step

__all__ = ["check_cluster", "padded_step", "rank_slowdowns"]


def rank_slowdowns(cluster: Cluster, world_size: int) -> tuple[float, ...]:
    """The slowdown of ranks 0 … world_size − 1: that of the cluster's device of the same
    rank. A cluster of fewer devices than workers is an error."""
    if cluster.num_devices < world_size:
        raise ValueError(
            f"cluster {cluster.name!r} has {cluster.num_devices} devices for {world_size} "
            "workers: give a cluster file with a device per worker, or fewer workers"
        )
    return tuple(float(cluster.device(r).slowdown) for r in range(world_size))


def check_cluster(name: str, world_size: int) -> tuple[float, ...]:
    """`rank_slowdowns` of the cluster file or preset `name` (errors name the file)."""
    try:
        return rank_slowdowns(load_cluster(name), world_size)
    except (ValueError, OSError) as err:
        raise ValueError(f"cluster={name!r}: {err}") from None


def padded_step(
    engine: Any, batch: Any, slowdown: float, sleep: Callable[[float], None] = time.sleep,
    *, index: int | None = None,
) -> Any:  # fmt: skip
    """`engine.step(batch)` (as step `index` of the run, if given), then a sleep of
    (slowdown − 1) × its compute time; the report."""
    report = engine.step(batch) if index is None else engine.step(batch, index=index)
    pad_step(report.result.records, slowdown, sleep)
    return report
