"""The runtime layout on 4 gloo workers: the mesh's groups under each rank order and ep,
per-parameter reduction groups, and a GPT trained under rank order tp-pp-dp."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from plait.config import ParallelPlan
from plait.layout import Layout
from plait.mesh import build_mesh
from plait.parallel.data import GradReducer

from .harness import run_world
from .test_hybrid import _check

pytestmark = pytest.mark.dist


def _ranks(group: dist.ProcessGroup | None) -> list[int]:
    assert group is not None
    return sorted(dist.get_process_group_ranks(group))


def _check_groups(rank: int) -> None:
    # dp=2 × pp=2 under tp-pp-dp: rank = pp + 2·dp (the table of tests/unit/test_layout.py)
    mesh = build_mesh(Layout(dp_replicate=2, pp=2, rank_order="tp-pp-dp"), "cpu").main
    assert _ranks(mesh.get_group("dp")) == [rank % 2, rank % 2 + 2]
    assert _ranks(mesh.get_group("pp")) == [rank - rank % 2, rank - rank % 2 + 1]
    # dp=4, ep=2: ep groups of neighbouring dp ranks, experts replicated over the others
    meshes = build_mesh(Layout(dp_replicate=4, ep=2), "cpu")
    assert _ranks(meshes.ep_group()) == [rank - rank % 2, rank - rank % 2 + 1]
    assert _ranks(meshes.expert_dp_group()) == [rank % 2, rank % 2 + 2]
    assert _ranks(meshes.main.get_group("dp")) == [0, 1, 2, 3]
    plain = build_mesh(Layout(dp_replicate=4), "cpu")
    assert plain.ep_group() is None and _ranks(plain.expert_dp_group()) == [0, 1, 2, 3]
    # dp=2 × tp=2, ep=2 borrows dp × tp ranks, tp innermost: an ep group is a tp group
    meshes = build_mesh(Layout(dp_replicate=2, tp=2, ep=2), "cpu")
    assert _ranks(meshes.ep_group()) == _ranks(meshes.main.get_group("tp"))
    assert _ranks(meshes.expert_dp_group()) == [rank % 2, rank % 2 + 2]
    # ep=1 under tp=2: every rank holds every expert, reduced over all dp × tp ranks
    meshes = build_mesh(Layout(dp_replicate=2, tp=2), "cpu", experts=True)
    assert meshes.ep_group() is None and _ranks(meshes.expert_dp_group()) == [0, 1, 2, 3]


def _check_two_groups(rank: int) -> None:
    """A over all 4 ranks, B over pairs {0, 2} and {1, 3}; each averaged over its group."""
    pairs = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    pair = pairs[rank % 2]
    torch.manual_seed(0)
    a, b = nn.Linear(3, 2), nn.Linear(2, 1)
    reducer = GradReducer(
        {0: [*a.parameters(), *b.parameters()]},
        dist.group.WORLD,  # type: ignore[arg-type]
        param_groups={p: pair for p in b.parameters()},
        bucket_bytes=16,
    )
    inputs = [torch.randn(5, 3, generator=torch.Generator().manual_seed(r)) for r in range(4)]

    def grads(x: torch.Tensor) -> list[torch.Tensor]:  # one rank's gradients, by hand
        out = b(a(x)).square().sum()
        return [g.detach() for g in torch.autograd.grad(out, [*a.parameters(), *b.parameters()])]

    per_rank = [grads(x) for x in inputs]
    mine = [r for r in range(4) if r % 2 == rank % 2]
    expected = [sum(g[i] for g in per_rank) / 4 for i in range(2)]
    expected += [sum(per_rank[r][i] for r in mine) / 2 for i in range(2, 4)]
    reducer.zero_grad()
    reducer.before_backward(0, last=True)
    b(a(inputs[rank])).square().sum().backward()
    reducer.after_backward(0, last=True)
    reducer.finish()
    for p, want in zip([*a.parameters(), *b.parameters()], expected, strict=True):
        assert p.grad is not None
        torch.testing.assert_close(p.grad, want, rtol=1e-5, atol=1e-6)


def _layout_world(rank: int, world: int) -> None:
    torch.use_deterministic_algorithms(True)
    _check_groups(rank)
    _check_two_groups(rank)
    _check(ParallelPlan(dp=2, pp=2, microbatches=2, rank_order="tp-pp-dp"))


def test_layout_on_four_workers(tmp_path: Path) -> None:
    run_world(tmp_path, 4, _layout_world)
