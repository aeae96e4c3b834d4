"""The Python API refuses arguments of the wrong kind at once, naming what it needs; no
process group is touched (none exists in a unit test)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import plait
from plait import ParallelPlan

_PLAN = ParallelPlan(pp=2, microbatches=2)


def _adam(params: Any) -> torch.optim.Optimizer:
    return torch.optim.Adam(params)


class _NoBlocks(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


@pytest.mark.parametrize(
    ("args", "says"),
    [
        ((5, _PLAN, _adam, nn.functional.mse_loss),
         r"model must be an nn\.Module whose layers can be cut into stages: an nn\.Sequential, "
         r"a module with a `blocks\(\)` method.*; got int 5"),
        ((_NoBlocks(), _PLAN, _adam, nn.functional.mse_loss),
         r"_NoBlocks cannot be cut into pipeline stages: pass an nn\.Sequential"),
        ((nn.Sequential(nn.Linear(2, 2)), {"pp": 2}, _adam, nn.functional.mse_loss),
         r"plan must be a plait\.ParallelPlan .*; got dict \{'pp': 2\}"),
        ((nn.Sequential(nn.Linear(2, 2)), _PLAN, torch.optim.Adam([torch.zeros(1)]),
          nn.functional.mse_loss),
         r"optimizer_factory must be a callable taking parameters.*; got Adam"),
        ((nn.Sequential(nn.Linear(2, 2)), _PLAN, _adam, "mse"),
         r"loss_fn must be a callable \(output, target\).*; got str 'mse'"),
    ],
)  # fmt: skip
def test_parallelize_names_what_it_needs(args: tuple[Any, ...], says: str) -> None:
    assert not torch.distributed.is_initialized()
    with pytest.raises(TypeError, match=says):
        plait.parallelize(*args)
