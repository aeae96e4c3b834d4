"""Reductions between pipelines that cut the model differently: per-block process groups,
the batch-share-weighted gradient reduction of synchronous heterogeneous plans, and the
per-wave update exchange of Wave Synchronous Parallel (Park et al., HetPipe, ATC 2020).

Block b sits on a different pipeline rank in each pipeline (`plait.pipelines`), so one
data-parallel group per stage, as in homogeneous plans, does not exist: the ranks that
hold the same blocks (one per pipeline) form a group, and each group reduces one flat
buffer of its blocks' tensors. Every rank issues its groups' reductions in the order of
their first block, the same order on every rank, so no two ranks wait on each other's
later reduction.

Synchronous: pipeline i computes g_i, the mean gradient over its B_i samples; the groups
all-reduce the sum of (B_i / B) · g_i, the gradient of the whole batch of B samples, so a
step equals one process on the whole batch whatever the shares.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist
from torch import nn

from plait.mesh import kept
from plait.pipelines import PipelineLayout

__all__ = ["BlockBuckets", "PipelineGroups", "ShareReducer", "pipeline_groups"]


@dataclass(frozen=True)
class PipelineGroups:
    """This rank's pipeline, its pipeline group, and the block groups it belongs to."""

    layout: PipelineLayout
    rank: int
    pipeline: int
    pp_group: dist.ProcessGroup
    # holders (one rank per pipeline) -> their group, for the groups holding this rank
    block_groups: dict[tuple[int, ...], dist.ProcessGroup]

    @property
    def pp_rank(self) -> int:
        return self.layout.ranks[self.pipeline].index(self.rank)


def pipeline_groups(layout: PipelineLayout) -> PipelineGroups:
    """Create every pipeline's group and every block group (all ranks take part in each
    creation, in the same order, as `dist.new_group` requires)."""
    rank = dist.get_rank()
    if dist.get_world_size() != layout.world_size:
        raise ValueError(
            f"the pipelines need {layout.world_size} workers ({[len(r) for r in layout.ranks]}) "
            f"but the world has {dist.get_world_size()}: start as many as the plan's pipelines hold"
        )
    pp_group = None
    for ranks in layout.ranks:
        group = kept(("pipeline", tuple(ranks)), partial(dist.new_group, list(ranks)))
        if rank in ranks:
            pp_group = group
    mine = {}
    for holders in layout.block_groups():
        group = kept(("blocks", tuple(sorted(holders))), partial(dist.new_group, sorted(holders)))
        if rank in holders:
            mine[holders] = group
    assert pp_group is not None
    return PipelineGroups(layout, rank, layout.pipeline_of(rank), pp_group, mine)


class BlockBuckets:
    """This rank's parameters grouped by the ranks that share them, in the order every rank
    uses; each bucket reads or writes its tensors as one flat buffer."""

    def __init__(self, groups: PipelineGroups, stages: Mapping[int, nn.Module]) -> None:
        by_block: dict[int, list[nn.Parameter]] = {}
        for stage in stages.values():
            first = int(getattr(stage, "first_block", 0))
            for j, block in enumerate(getattr(stage, "blocks", [stage])):
                by_block[first + j] = [p for p in block.parameters() if p.requires_grad]
        self.buckets: list[tuple[dist.ProcessGroup, tuple[int, ...], list[nn.Parameter]]] = []
        for holders, blocks in groups.layout.block_groups().items():
            if holders in groups.block_groups:
                params = [p for b in blocks for p in by_block[b]]
                self.buckets.append((groups.block_groups[holders], holders, params))

    def flat(self, index: int, *, grads: bool = False) -> torch.Tensor:
        """Bucket `index`'s parameters (or their gradients, zero where none) as one tensor."""
        params = self.buckets[index][2]
        if grads:
            parts = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
            return torch.cat([t.reshape(-1) for t in parts])
        return torch.cat([p.detach().reshape(-1) for p in params])

    @torch.no_grad()
    def add(self, index: int, flat: torch.Tensor) -> None:
        """Add `flat` (laid out as `flat(index)`) to bucket `index`'s parameters."""
        _scatter(self.buckets[index][2], flat, lambda p, x: p.add_(x))

    @torch.no_grad()
    def copy_in(self, index: int, flat: torch.Tensor) -> None:
        _scatter(self.buckets[index][2], flat, lambda p, x: p.copy_(x))

    @torch.no_grad()
    def set_grads(self, index: int, flat: torch.Tensor) -> None:
        def put(p: nn.Parameter, x: torch.Tensor) -> None:
            p.grad = x.clone()

        _scatter(self.buckets[index][2], flat, put)

    def __len__(self) -> int:
        return len(self.buckets)


def _scatter(
    params: Sequence[nn.Parameter],
    flat: torch.Tensor,
    fn: Callable[[nn.Parameter, torch.Tensor], object],
) -> None:
    offset = 0
    for p in params:
        n = p.numel()
        fn(p, flat[offset : offset + n].view_as(p))
        offset += n


class ShareReducer:
    """A `GradSync` for synchronous heterogeneous plans: at `finish`, every block group
    all-reduces Σ_i share_i · g_i (see the module docstring). The reductions start
    together once every backward is done (no overlap with backward: a rank's stages would
    otherwise issue them in backward order, which differs between pipelines)."""

    def __init__(self, buckets: BlockBuckets, share: float) -> None:
        self.buckets, self.share = buckets, share
        self._done = False

    def before_backward(self, stage: int, *, last: bool) -> None:
        self._done = False

    def after_backward(self, stage: int, *, last: bool) -> None:
        pass

    def reduce(self, stage: int) -> None:
        pass

    def zero_grad(self, stage: int | None = None) -> None:
        self._done = False

    def finish(self, stage: int | None = None) -> None:
        if self._done:
            return
        works = []
        for i in range(len(self.buckets)):
            flat = self.buckets.flat(i, grads=True).mul_(self.share)
            group = self.buckets.buckets[i][0]
            works.append((i, flat, dist.all_reduce(flat, group=group, async_op=True)))
        for i, flat, work in works:
            work.wait()
            self.buckets.set_grads(i, flat)
        self._done = True
