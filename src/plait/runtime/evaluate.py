"""Forward-only evaluation of one rank's stages: a program of F/SEND_F/RECV_F actions run by
the executor's own forward path, transport and labels.

The program is not a window of the training schedule: a training window interleaves
backwards and UPDATEs (and, for an asynchronous schedule, belongs to a stream whose windows
overlap), so filtering it would leave receives ordered for a stream that evaluation does not
run. `forward_program` instead lists, micro-batch by micro-batch along its path of stages,
each local stage's receive, forward and send: every rank meets its peers in the same order,
sends are asynchronous, so it cannot deadlock. It runs on a fresh `Transport` after the
training stream has settled (a synchronous window settles its sends; an asynchronous stream
must be drained first, which `plait.train.Engine.evaluate` does), so no training message
can match an evaluation receive. Weights are each stage's live ones, i.e. its newest version.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch.autograd.profiler import record_function

from plait.compat import profiler_enabled, pytree
from plait.runtime.boundary import flatten, unflatten
from plait.runtime.transport import Transport
from plait.schedule import Action, Op, Schedule

if TYPE_CHECKING:
    from plait.runtime.executor import PipelineExecutor

__all__ = ["EvalSums", "MetricFn", "evaluate", "forward_program"]

# (output, targets) -> the sum over the samples, a tensor or a number
MetricFn = Callable[[Any, Any], torch.Tensor | float]


@dataclass(frozen=True)
class EvalSums:
    """This rank's sums over the micro-batches its last stages finished (zeros elsewhere):
    [loss × samples, samples, metric sums in the order of the names]."""

    values: torch.Tensor
    names: tuple[str, ...]


def forward_program(schedule: Schedule, rank: int, num_microbatches: int) -> list[Action]:
    """`rank`'s forward-only program over micro-batches 0..num_microbatches-1."""
    program: list[Action] = []
    owner = schedule.stage_to_rank
    for m in range(num_microbatches):
        for s in schedule.path(m):
            if owner[s] != rank:
                continue
            before, after = schedule.prev_stage(s), schedule.next_stage(s)
            if before is not None and owner[before] != rank:
                program.append(Action(Op.RECV_F, s, m))
            program.append(Action(Op.F, s, m))
            if after is not None and owner[after] != rank:
                program.append(Action(Op.SEND_F, s, m))
    return program


def evaluate(
    executor: PipelineExecutor,
    inputs: Sequence[Any] | None,
    targets: Sequence[Any] | None,
    metrics: Mapping[str, MetricFn],
    count: int | None = None,
) -> EvalSums:
    """Run the forward-only program over `count` micro-batches (default: a window's) on
    `executor`'s stages without gradients, in eval mode (dropout off, batch-norm statistics
    untouched), under its forward context (autocast)."""
    schedule = executor.schedule
    count = schedule.num_microbatches if count is None else count
    program = forward_program(schedule, executor.rank, count)
    transport = Transport(
        schedule, executor.rank, executor.group, timeout_s=executor.transport.timeout_s
    )
    names = tuple(metrics)
    sums = torch.zeros(2 + len(names), device=executor.device, dtype=torch.float64)
    local: dict[tuple[int, int], Any] = {}
    modes = {s: module.training for s, module in executor.stages.items()}
    labelled = profiler_enabled()
    try:
        for module in executor.stages.values():
            module.eval()
        with torch.no_grad():
            for a in program:
                with record_function(f"EVAL:{a}") if labelled else contextlib.nullcontext():
                    _do(executor, transport, a, inputs, targets, metrics, local, sums)
        transport.settle(0)
    finally:
        for s, module in executor.stages.items():
            module.train(modes[s])
    return EvalSums(sums, names)


def _do(
    executor: PipelineExecutor,
    transport: Transport,
    a: Action,
    inputs: Sequence[Any] | None,
    targets: Sequence[Any] | None,
    metrics: Mapping[str, MetricFn],
    local: dict[tuple[int, int], Any],
    sums: torch.Tensor,
) -> None:
    schedule, s, mb = executor.schedule, a.stage, a.microbatch
    meta = executor._meta
    if a.op is Op.RECV_F:
        transport.post(a, meta, executor.device)
        return
    if a.op is Op.SEND_F:
        transport.send(a, local.pop((s, mb)), 0)
        return
    before, after = schedule.prev_stage(s), schedule.next_stage(s)
    if before is None:
        assert inputs is not None
        value = inputs[mb]
    elif schedule.stage_to_rank[before] == executor.rank:
        value = local.pop((before, mb))
    else:
        leaves, _ = transport.take((Op.RECV_F, s, mb), a)
        value = unflatten(meta[s], leaves)
    with executor.forward_context():
        out = executor.stages[s](value)
        if after is None:
            assert targets is not None
            target = targets[mb]
            loss = executor.loss_fn(out, target).double()
            values = [
                torch.as_tensor(fn(out, target), dtype=torch.float64, device=loss.device)
                for fn in metrics.values()
            ]
    if after is not None:
        detached = [t.detach() for t in flatten(out)]
        if schedule.stage_to_rank[after] == executor.rank:
            local[(s, mb)] = unflatten(meta[after], detached)
        else:
            local[(s, mb)] = detached
        return
    samples = _samples(target)
    sums[0] += loss.to(sums.device) * samples
    sums[1] += samples
    for i, v in enumerate(values):
        sums[2 + i] += v.to(sums.device)


def _samples(target: Any) -> int:
    leaves = [t for t in pytree.tree_leaves(target) if isinstance(t, torch.Tensor)]
    return int(leaves[0].shape[0]) if leaves else 1
