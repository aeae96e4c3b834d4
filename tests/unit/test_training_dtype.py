"""What runs before training runs in the training's dtype: the pipeline's boundary probes
and the profiler's block timings (fp32 weights, the forward under autocast)."""

from __future__ import annotations

import torch
from torch import nn

from plait.device import autocast_context
from plait.profile import profile_blocks
from plait.runtime.boundary import negotiate
from plait.schedule import build

CPU = torch.device("cpu")


def _stages() -> dict[int, nn.Module]:
    torch.manual_seed(0)
    return {0: nn.Linear(8, 6), 1: nn.Linear(6, 3)}


def test_the_boundary_probe_describes_what_a_bf16_stage_sends() -> None:
    schedule = build("interleaved", 1, 2, 2)  # stages 0 and 1 on one rank
    stages, sample = _stages(), torch.randn(4, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the reference: stage 0 as trained
        sent = stages[0](sample)
    bf16 = negotiate(schedule, stages, 0, sample, group=None, device=CPU,
                     forward_context=autocast_context("bf16", CPU))  # fmt: skip
    assert bf16[1].dtypes == (str(sent.dtype).removeprefix("torch."),) == ("bfloat16",)
    assert bf16[1].shapes == ((4, 6),)
    fp32 = negotiate(schedule, stages, 0, sample, group=None, device=CPU)
    assert fp32[1].dtypes == ("float32",)


def test_blocks_are_profiled_in_the_training_dtype_without_touching_the_model() -> None:
    blocks = list(_stages().values())
    before = [p.detach().clone() for b in blocks for p in b.parameters()]
    sample = torch.randn(4, 8)
    for dtype, size in (("fp32", 4), ("bf16", 2)):
        found = profile_blocks(blocks, sample, warmup=0, repeats=1, device=CPU, dtype=dtype)
        # a block hands on [4, out] in the autocast dtype; the weights stay fp32
        assert [b.activation_bytes for b in found] == [4 * 6 * size, 4 * 3 * size]
        assert [b.param_bytes for b in found] == [(8 * 6 + 6) * 4, (6 * 3 + 3) * 4]
    after = [p for b in blocks for p in b.parameters()]
    assert all(p.grad is None for p in after)  # copies were measured
    for old, new in zip(before, after, strict=True):
        torch.testing.assert_close(new, old, rtol=0, atol=0)
