"""Summing the gradients of a model part's replicas across pipeline ranks (Chimera).

A schedule that runs several pipelines over the same parts (`Schedule.parts`) holds a
replica of a part on each pipeline; each replica accumulates the gradients of the
micro-batches of its own pipeline, each micro-batch's loss scaled by 1/m of the whole
window. A part's gradient is therefore the sum of its replicas' gradients, which
`ReplicaSync.finish` forms on every replica (after the data-parallel reduction it
wraps), so that the replicas, stepped by identical optimizers from identical weights,
stay identical. Chimera sums at the end of the step too (its eager `nb_sync_grad` only
starts earlier); torch has no bidirectional pipeline to borrow this from.

The ranks holding the replicas of one part form a group (for Chimera, ranks k and
p - 1 - k, which hold the replicas of the same two parts); one group per such set of
pipeline ranks in every (dp, tp) slice of the mesh, made by `replica_groups` on every
rank in the same order. Each group sums one flat buffer of all the parts it shares, in
part order; replicas on the same rank are added locally first.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from plait.mesh import kept
from plait.runtime.sync import GradSync
from plait.schedule import Schedule

__all__ = ["ReplicaSync", "replica_groups", "uncounted_params", "with_replicas"]

RankSet = tuple[int, ...]  # pipeline ranks holding the replicas of a part


def _rank_sets(schedule: Schedule) -> dict[int, RankSet]:
    """Per part, the sorted pipeline ranks holding its replicas."""
    place = schedule.stage_to_rank
    return {
        k: tuple(sorted({place[s] for s in schedule.replicas(k)}))
        for k in range(schedule.num_parts)
    }


def replica_groups(schedule: Schedule, mesh: DeviceMesh) -> dict[RankSet, dist.ProcessGroup]:
    """The process group of each set of pipeline ranks (of more than one) that this rank's
    slice of the mesh uses to sum replicas. A collective: every rank calls it."""
    names = mesh.mesh_dim_names
    assert names is not None and "pp" in names
    slices = mesh.mesh.movedim(names.index("pp"), 0).reshape(schedule.num_ranks, -1)
    mine = dist.get_rank()
    out: dict[RankSet, dist.ProcessGroup] = {}
    for rank_set in sorted(set(_rank_sets(schedule).values())):
        if len(rank_set) < 2:
            continue
        for column in slices.t().tolist():
            ranks = [column[r] for r in rank_set]
            group = kept(("replicas", tuple(ranks)), partial(dist.new_group, ranks))
            if mine in ranks:
                out[rank_set] = group
    return out


class ReplicaSync:
    """A `GradSync` that, after `inner`'s reduction, sums each part's replica gradients
    over `groups` (from `replica_groups`) at `finish`; the rest passes through."""

    def __init__(
        self,
        inner: GradSync | None,
        schedule: Schedule,
        stages: Mapping[int, nn.Module],
        groups: Mapping[RankSet, dist.ProcessGroup],
    ) -> None:
        self.inner, self.schedule, self.stages, self.groups = inner, schedule, stages, groups
        self.rank_sets = _rank_sets(schedule)

    def before_backward(self, stage: int, *, last: bool) -> None:
        if self.inner is not None:
            self.inner.before_backward(stage, last=last)

    def after_backward(self, stage: int, *, last: bool) -> None:
        if self.inner is not None:
            self.inner.after_backward(stage, last=last)

    def reduce(self, stage: int) -> None:
        if self.inner is not None:
            self.inner.reduce(stage)

    def zero_grad(self, stage: int | None = None) -> None:
        if self.inner is not None:
            self.inner.zero_grad(stage)

    def finish(self, stage: int | None = None) -> None:
        """Wait for `inner`, then sum every part's replicas (all parts: the step is
        synchronous, so `stage` is None)."""
        assert stage is None, "replicated parts update together, once per step"
        if self.inner is not None:
            self.inner.finish()
        parts = sorted({self.schedule.parts[s] for s in self.stages})
        for rank_set in sorted({self.rank_sets[k] for k in parts}):
            shared = [k for k in parts if self.rank_sets[k] == rank_set]
            self._sum(shared, self.groups.get(rank_set))

    def _grads(self, part: int) -> list[list[torch.Tensor]]:
        """Per local replica of `part`, its parameters' gradients (zeros where unused)."""
        out = []
        for s in self.schedule.replicas(part):
            if s in self.stages:
                grads = []
                for p in self.stages[s].parameters():
                    if p.requires_grad:
                        if p.grad is None:
                            p.grad = torch.zeros_like(p)
                        grads.append(p.grad)
                out.append(grads)
        return out

    def _sum(self, parts: list[int], group: dist.ProcessGroup | None) -> None:
        per_part = [self._grads(k) for k in parts]
        local = [torch.cat([g.reshape(-1) for g in replicas[0]]) for replicas in per_part]
        for total, replicas in zip(local, per_part, strict=True):
            for other in replicas[1:]:
                total += torch.cat([g.reshape(-1) for g in other])
        flat = torch.cat(local)
        if group is not None:
            dist.all_reduce(flat, group=group)
        at = 0
        for replicas in per_part:
            for grads in replicas:
                offset = at
                for g in grads:
                    g.copy_(flat[offset : offset + g.numel()].view_as(g))
                    offset += g.numel()
            at += sum(g.numel() for g in replicas[0])


def with_replicas(
    inner: GradSync | None, schedule: Schedule, stages: Mapping[int, nn.Module], mesh: DeviceMesh
) -> GradSync | None:
    """`inner` wrapped in a `ReplicaSync` when `schedule` replicates parts, else `inner`.
    A collective when it wraps (`replica_groups`)."""
    if schedule.num_parts == schedule.num_stages:
        return inner
    return ReplicaSync(inner, schedule, stages, replica_groups(schedule, mesh))


def uncounted_params(schedule: Schedule, stages: Mapping[int, nn.Module]) -> list[nn.Parameter]:
    """The parameters of every replica but a part's first: a global gradient norm counts
    each part once (its replicas hold the same summed gradient)."""
    first = {schedule.replicas(k)[0] for k in range(schedule.num_parts)}
    return [p for s, m in stages.items() if s not in first for p in m.parameters()]
