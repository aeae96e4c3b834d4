"""Dynamic re-partitioning: move blocks between pipeline ranks while training, between steps.

After ElasticPipe (Geng, Li, Wang, ScienceCloud 2019), which periodically collects the
devices' performance and redistributes the workload at run time (seed 003's "periodic
shuffling of the partitions"). Each step the executor's action stamps give every stage's
compute seconds (forward and backward actions, waits excluded); the ranks share them. A
calibration (the first measured step, when the workers are assumed equal) spreads each
stage's time evenly over its blocks: the per-block costs (the first step of an engine,
which also negotiates the boundaries' shapes, is not measured). Later steps give each rank's
speed as its blocks' cost over its measured time. When the slowest stage takes more than
(1 + threshold) × the fastest for `patience` steps in a row, `plait.plan.partition`
splits the per-block costs over the ranks' speeds anew, and if the split differs, the
blocks that change owner move, weights and optimizer state, from their old rank to their
new one, and the engine is rebuilt on the new partition (`parallelize`). The step after a
move computes exactly what it would have computed without it.

Limits: synchronous schedules only (an asynchronous one would also have to move stashed
weight versions and drain first), and without data or tensor parallelism: the gradient
reducer's hooks cannot be removed from parameters yet, and tensor parallelism and FSDP
shard modules in place (REVIEW §3(g)). Moved state travels pickled through the process
group (`send_object_list`), which is simple and device-agnostic but not fast; in a
contiguous split blocks only move between neighbouring stages. Re-applied offload hooks
nest on blocks a rank keeps (harmless: the innermost packs).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from plait.blocks import as_blocks
from plait.config import ParallelPlan, TrainConfig
from plait.plan.partition import partition
from plait.schedule import Op
from plait.train.engine import Engine, StepReport
from plait.train.logs import LOGGER

__all__ = ["Repartitioner", "repartitioner", "stage_seconds"]

Build = Callable[[ParallelPlan], Engine]
_COMPUTE = (Op.F, Op.B, Op.BI, Op.BW)


def stage_seconds(engine: Engine, report: StepReport) -> list[float]:
    """Compute seconds of every stage in the step `report` describes, as every rank sees
    them (one all-reduce over the pipeline group)."""
    program = engine.schedule.ranks[engine.executor.rank]
    times = [0.0] * engine.schedule.num_stages
    for record in report.result.records:
        action = program[record.index]
        if action.op in _COMPUTE:
            times[action.stage] += record.end - record.start
    found = torch.tensor(times, dtype=torch.float64, device=engine.device)
    dist.all_reduce(found, group=engine.mesh.get_group("pp"))
    return [float(t) for t in found.tolist()]


@dataclass
class Repartitioner:
    """Watches step times and re-partitions an engine built by `build(plan)` from `model`
    (the whole model every rank passed to `parallelize`). Call `after_step` after every
    step; it returns the engine to go on with (a new one after a move)."""

    model: nn.Module
    build: Build
    threshold: float = 0.2
    patience: int = 3
    block_costs: list[float] | None = None  # per block; None: calibrated at the first step
    moves: list[tuple[int, tuple[int, ...]]] = field(default_factory=list)  # (step, sizes)
    _late: int = 0
    _engine: Engine | None = None

    def __post_init__(self) -> None:
        if not self.threshold > 0:
            raise ValueError(f"repartition_threshold={self.threshold} must be positive")
        if self.patience < 1:
            raise ValueError(f"repartition_patience={self.patience} must be >= 1")

    def after_step(self, engine: Engine, report: StepReport, step: int) -> Engine:
        """The engine for the next step: `engine`, or a re-partitioned one."""
        seconds = stage_seconds(engine, report)
        if self._engine is not engine:  # its first step also describes the boundaries
            self._engine = engine
            return engine
        sizes = _sizes(engine)
        if self.block_costs is None:
            self.block_costs = [
                t / n for t, n in zip(seconds, sizes, strict=True) for _ in range(n)
            ]
            return engine
        slow, fast = max(seconds), min(seconds)
        self._late = self._late + 1 if slow > (1 + self.threshold) * fast else 0
        if self._late < self.patience:
            return engine
        self._late = 0
        new = self.proposal(sizes, seconds)
        if new == sizes:
            return engine
        return self.move(engine, new, step)

    def proposal(self, sizes: Sequence[int], seconds: Sequence[float]) -> tuple[int, ...]:
        """The partitioner's split of the per-block costs over the speeds the stages
        showed (their blocks' calibrated cost over their measured seconds)."""
        assert self.block_costs is not None
        bounds = [0, *_cumsum(sizes)]
        speeds = [
            sum(self.block_costs[a:b]) / max(t, 1e-12)
            for (a, b), t in zip(itertools.pairwise(bounds), seconds, strict=True)
        ]
        return partition(self.block_costs, len(sizes), speeds=speeds).sizes

    def move(self, engine: Engine, sizes: Sequence[int], step: int) -> Engine:
        """Move to the partition `sizes` now (between steps): blocks that change rank send
        their weights and optimizer state to their new owner, and the engine is rebuilt.
        Every rank calls it with the same `sizes`."""
        _check_movable(engine)
        old = _sizes(engine)
        blocks = as_blocks(self.model)
        place = engine.schedule.stage_to_rank
        old_owner = [place[s] for s, n in enumerate(old) for _ in range(n)]
        new_owner = [place[s] for s, n in enumerate(sizes) for _ in range(n)]
        state = _param_state(engine)
        received = _exchange(engine, blocks, state, old_owner, new_owner)
        plan = dataclasses.replace(engine.plan, partition=tuple(sizes))
        rebuilt = self.build(plan)
        _restore_optimizers(engine, rebuilt, {**state, **received})
        self.moves.append((step, tuple(sizes)))  # the block costs hold: blocks are the same
        logging.getLogger(LOGGER).info(
            "re-partitioned after step %d: blocks per stage %s -> %s", step + 1, list(old),
            list(sizes),
        )  # fmt: skip
        return rebuilt


def repartitioner(cfg: TrainConfig, model: nn.Module, build: Build) -> Repartitioner | None:
    """The run's re-partitioning policy (`cfg.repartition`), or None when it is off."""
    if cfg.repartition == "off":
        return None
    return Repartitioner(
        model, build, threshold=cfg.repartition_threshold, patience=cfg.repartition_patience
    )


def _sizes(engine: Engine) -> tuple[int, ...]:
    sizes = engine.plan.partition
    if sizes is None:
        from plait.blocks import equal_split

        sizes = tuple(equal_split(len(engine.block_names), engine.schedule.num_stages))
    return tuple(sizes)


def _cumsum(values: Sequence[int]) -> list[int]:
    out, total = [], 0
    for v in values:
        total += v
        out.append(total)
    return out


def _check_movable(engine: Engine) -> None:
    plan = engine.plan
    if not engine.synchronous or plan.dp > 1 or plan.tp > 1:
        raise ValueError(
            f"re-partitioning needs a synchronous schedule without data or tensor parallelism "
            f"(schedule={plan.schedule!r}, dp={plan.dp}, tp={plan.tp}): use repartition='off'"
        )


def _param_state(engine: Engine) -> dict[torch.Tensor, dict[str, Any]]:
    """This rank's optimizer state per parameter (the tensors themselves)."""
    out: dict[torch.Tensor, dict[str, Any]] = {}
    for opt in engine.optimizers.values():
        for p, s in opt.state.items():
            out[p] = dict(s)
    return out


def _exchange(
    engine: Engine,
    blocks: Sequence[nn.Module],
    state: dict[torch.Tensor, dict[str, Any]],
    old_owner: list[int],
    new_owner: list[int],
) -> dict[torch.Tensor, dict[str, Any]]:
    """Send the moving blocks' weights and optimizer state to their new pipeline rank;
    load what this rank receives into its copies of those blocks. Returns the received
    optimizer state by parameter. Pairs of ranks are served in one order on every rank,
    so the blocking sends and receives cannot wait on each other in a cycle."""
    me, group = engine.executor.rank, engine.mesh.get_group("pp")
    pairs = sorted({(a, b) for a, b in zip(old_owner, new_owner, strict=True) if a != b})
    received: dict[torch.Tensor, dict[str, Any]] = {}
    for src, dst in pairs:
        moving = [i for i, (a, b) in enumerate(zip(old_owner, new_owner, strict=True))
                  if (a, b) == (src, dst)]  # fmt: skip
        params = [p for i in moving for p in blocks[i].parameters()]
        if me == src:
            payload = [
                (p.detach().cpu(), {k: _cpu(v) for k, v in state.get(p, {}).items()})
                for p in params
            ]
            dist.send_object_list([payload], dst=dist.get_global_rank(group, dst), group=group)
        elif me == dst:
            box: list[Any] = [None]
            dist.recv_object_list(box, src=dist.get_global_rank(group, src), group=group)
            for p, (value, opt_state) in zip(params, box[0], strict=True):
                with torch.no_grad():
                    p.copy_(value.to(p.device))
                received[p] = {k: _to(v, p.device) for k, v in opt_state.items()}
    return received


def _cpu(value: Any) -> Any:
    return value.detach().cpu() if isinstance(value, torch.Tensor) else value


def _to(value: Any, device: torch.device) -> Any:
    # scalar step counts stay on the host, where torch's optimizers keep them
    if isinstance(value, torch.Tensor) and value.dim() > 0:
        return value.to(device)
    return value


def _restore_optimizers(
    old: Engine, new: Engine, state: dict[torch.Tensor, dict[str, Any]]
) -> None:
    """Give the rebuilt optimizers the state of their parameters, the schedules' position
    and the learning rate it reached. A stage's parameter groups may differ from the old
    stage's (a block with no weight-decay exclusions): the rate is carried as the factor
    the schedule applies to each group's own initial rate, never group by group."""
    template = next(iter(old.optimizers.values())).param_groups[0]
    schedule = next(iter(old.schedulers.values()), None)
    factor = template["lr"] / template["initial_lr"] if "initial_lr" in template else None
    for s, opt in new.optimizers.items():
        for group in opt.param_groups:
            if factor is not None:
                group["lr"] = group["initial_lr"] * factor
            for p in group["params"]:
                if p in state:  # received state sits where the block was; follow it
                    opt.state[p] = {k: _to(v, p.device) for k, v in state[p].items()}
        if schedule is not None and s in new.schedulers:
            position = schedule.state_dict()
            position["base_lrs"] = [g["initial_lr"] for g in opt.param_groups]
            position["_last_lr"] = [g["lr"] for g in opt.param_groups]
            new.schedulers[s].load_state_dict(position)
