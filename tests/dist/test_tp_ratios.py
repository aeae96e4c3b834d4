"""The planner's measured tensor-parallel blocks (`plait.profile.sharded.tp_ratios`) on 2
gloo workers: the sharded copy it times computes what the whole block computes (outputs
and input gradients equal to 1e-5: it times the real sharded block, not a stand-in), and
it answers a (forward, backward, input half, weight half) share for every degree,
sequence-parallel setting and sample size, on every rank. A model with no sharded block
answers nothing."""

from __future__ import annotations

import math
from typing import Any

import pytest

pytestmark = pytest.mark.dist


def _worker(world: int) -> tuple[Any, ...]:
    import copy

    import torch
    from torch import nn

    from plait.blocks import as_blocks
    from plait.layout import Layout
    from plait.mesh import build_mesh, init_worker
    from plait.models.gpt import GPT, GPTConfig
    from plait.parallel.tensor import shard_block
    from plait.profile.sharded import tp_degrees, tp_ratios

    init_worker(device="cpu")
    torch.manual_seed(0)
    model = GPT(GPTConfig(num_layers=2, hidden=32, num_heads=4, seq_len=16))
    tokens = torch.randint(0, 96, (4, 16))
    block = as_blocks(model)[1]
    x = torch.randn(2, 16, 32)
    sharded = copy.deepcopy(block)
    shard_block(sharded, build_mesh(Layout(tp=2), "cpu").main["tp"])
    a, b = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    out_whole, out_sharded = block(a), sharded(b)
    out_whole.square().sum().backward()
    out_sharded.square().sum().backward()
    assert a.grad is not None and b.grad is not None
    out_err = (out_whole - out_sharded).abs().max().item()
    grad_err = (a.grad - b.grad).abs().max().item()
    samples = [(tokens[:1], None), (tokens[:4], None)]
    ratios = tp_ratios(model, samples, degrees=tp_degrees(world, 4),
                       sequence_parallel=(False, True), repeats=2, warmup=1)  # fmt: skip
    plain = nn.Sequential(nn.Linear(4, 4))  # no block with a tp_plan
    none = tp_ratios(plain, [(torch.randn(1, 4), None)], degrees=[2])
    return out_err, grad_err, ratios, none


def test_tp_ratios_time_the_real_sharded_block_at_every_degree_and_size() -> None:
    from plait.train import launch

    found = launch(_worker, 2, 2)
    for out_err, grad_err, ratios, none in found.values():
        assert out_err < 1e-5 and grad_err < 1e-5
        assert set(ratios) == {(2, False), (2, True)}
        for shares in ratios.values():
            assert set(shares) == {1, 4}
            # forward, backward, and the split backward's input and weight halves
            assert all(len(four) == 4 for four in shares.values())
            assert all(math.isfinite(s) and s > 0 for four in shares.values() for s in four)
        assert none == {}


def _refused(world: int) -> str:
    from plait.mesh import init_worker
    from plait.models.gpt import GPT, GPTConfig
    from plait.profile.sharded import tp_ratios

    init_worker(device="cpu")
    try:
        tp_ratios(GPT(GPTConfig(num_layers=1, hidden=32, num_heads=4)), [], degrees=[3])
    except ValueError as error:
        return str(error)
    return ""


def test_tp_ratios_refuse_a_degree_that_does_not_divide_the_workers() -> None:
    from plait.train import launch

    for message in launch(_refused, 2, 2).values():
        assert "tp degrees [3]" in message and "divide the 2 workers" in message


def _emulated_core(world: int, folder: str) -> tuple[Any, ...]:
    """Both workers on one emulated core: a whole block timed while the other worker
    times one too takes 2 s a part, alone 1 s; a sharded block 3 s (every rank at once)."""
    import os
    import time
    from pathlib import Path

    import torch

    import plait.profile.sharded as sharded
    from plait.mesh import init_worker
    from plait.models.gpt import GPT, GPTConfig

    env, _ = init_worker(device="cpu")
    mine, theirs = Path(folder, f"busy{env.rank}"), Path(folder, f"busy{1 - env.rank}")

    def scripted(block: Any, *args: Any, **kwargs: Any) -> tuple[float, ...]:
        if any(type(p).__name__ == "DTensor" for p in block.parameters()):
            return (3.0,) * 4
        mine.touch()
        time.sleep(0.2)  # long enough for the other worker's timing to overlap, if it runs
        shared = theirs.exists()
        time.sleep(0.2)
        os.remove(mine)
        return (2.0 if shared else 1.0,) * 4

    sharded._time_block = scripted
    torch.manual_seed(0)
    model = GPT(GPTConfig(num_layers=2, hidden=32, num_heads=4, seq_len=16))
    samples = [(torch.randint(0, 96, (2, 16)), None)]
    turns = sharded.tp_ratios(model, samples, degrees=[2], repeats=3, warmup=0, cores=1,
                              sharing_efficiency=0.8)  # fmt: skip
    together = sharded.tp_ratios(model, samples, degrees=[2], repeats=3, warmup=0)
    return turns[(2, False)][2], together[(2, False)][2]


def test_on_shared_cores_the_sharded_block_is_priced_alone(tmp_path: Any) -> None:
    # cores=1: the whole block is timed one worker at a time (1 s), the sharded one by
    # both at once (3 s, two workers on the core), priced alone at 3 × 0.8 / 2 = 1.2 of it;
    # with a core each (the default) both are timed at once: 3 / 2
    from plait.train import launch

    for turns, together in launch(_emulated_core, 2, 2, str(tmp_path)).values():
        assert turns == pytest.approx((1.2,) * 4)
        assert together == pytest.approx((1.5,) * 4)
