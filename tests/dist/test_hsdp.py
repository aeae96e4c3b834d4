"""HSDP: dp_replicate=2 × dp_shard=2 on 4 gloo workers trains the GPT to the losses and
gradients of one process on the whole batch, with parameters sharded inside a replica
group and replicated across the two."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

from plait.config import ParallelPlan
from plait.train.parallelize import parallelize

from .harness import run_world
from .test_hybrid import _check, _model

pytestmark = pytest.mark.dist


def _hsdp(rank: int, world: int) -> None:
    torch.use_deterministic_algorithms(True)
    for zero in (3, 2):
        plan = ParallelPlan(dp_replicate=2, dp_shard=2, pp=1, zero=zero, microbatches=2)
        _check(plan)
    plan = ParallelPlan(dp_replicate=2, dp_shard=2, pp=1, microbatches=2)
    engine = parallelize(_model(), plan, torch.optim.SGD, lambda o, t: o.sum(), device="cpu")
    for stage in engine.stages.values():
        for p in stage.parameters():
            mesh = p.device_mesh  # type: ignore[attr-defined]
            assert mesh.mesh_dim_names == ("dp_replicate", "dp_shard")
            assert tuple(p.placements) == (Replicate(), Shard(0))  # type: ignore[attr-defined]
            # rank = shard + 2·replicate (tp-dp-pp): shard inside, replicas across
            assert mesh.mesh.tolist() == [[0, 1], [2, 3]]


def test_hsdp_two_by_two_matches_one_process(tmp_path: Path) -> None:
    run_world(tmp_path, 4, _hsdp)
