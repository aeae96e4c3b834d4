"""Hangs become errors: a rank whose peer stalls raises `PipelineTimeout` within its
timeout, naming itself, the action that waited and the peer.

One gloo world of two processes holds three fresh process groups (a group whose wait
timed out is left with unmatched messages, so each scenario gets its own): on pipeline A
rank 0 stops after one step and rank 1 times out waiting for activations; on pipeline B
rank 1 stops and rank 0 times out waiting for gradients (both at once: each rank is the
other's stalled peer); on group C rank 0's data-parallel reducer times out, rank 1 never
reducing. A barrier on the default group, untouched by any timeout, lets both ranks
finish cleanly.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from plait.models import SkipMLP
from plait.parallel import GradReducer
from plait.runtime import (
    DEFAULT_TIMEOUT_S,
    PipelineExecutor,
    PipelineTimeout,
    local_stages,
    split_microbatches,
)
from plait.schedule import build

from .harness import run_world

pytestmark = pytest.mark.dist

TIMEOUT = 2.0
M = 2  # micro-batches per window: window 1 runs micro-batches 2 and 3


def _executor(rank: int, group: dist.ProcessGroup | None, **kwargs: float) -> PipelineExecutor:
    torch.manual_seed(0)
    schedule = build("1f1b", 2, M)
    stages = local_stages(SkipMLP(dim=6, hidden=10, classes=4, num_blocks=4), schedule, rank)
    return PipelineExecutor(
        schedule, stages, rank=rank, loss_fn=SkipMLP.loss, group=group, **kwargs
    )


def _step(executor: PipelineExecutor, rank: int) -> None:
    x, y = torch.randn(2 * M, 6), torch.randint(0, 4, (2 * M,))
    xs, ys = split_microbatches(x, M), split_microbatches(y, M)
    executor.step(xs if rank == 0 else None, ys if rank == 1 else None)


def _times_out(executor: PipelineExecutor, rank: int) -> str:
    """The message of the `PipelineTimeout` the next step raises, checked to come after
    the timeout and well before a hang."""
    start = time.perf_counter()
    with pytest.raises(PipelineTimeout) as info:
        _step(executor, rank)
    elapsed = time.perf_counter() - start
    assert 0.9 * TIMEOUT <= elapsed < 20.0, f"rank {rank} raised after {elapsed:.1f} s"
    print(f"\n{info.value}", flush=True)  # shown with pytest -s
    return str(info.value)


def _reducer_times_out(group: dist.ProcessGroup) -> str:
    """Rank 0 reduces stage 0's gradients over `group`; nobody else does."""
    layer = torch.nn.Linear(3, 2)
    reducer = GradReducer({0: list(layer.parameters())}, group, timeout_s=TIMEOUT)
    reducer.before_backward(0, last=True)
    layer(torch.randn(4, 3)).sum().backward()
    reducer.after_backward(0, last=True)
    reducer.reduce(0)
    start = time.perf_counter()
    with pytest.raises(PipelineTimeout) as info:
        reducer.finish(0)
    assert 0.9 * TIMEOUT <= time.perf_counter() - start < 20.0
    print(f"\n{info.value}", flush=True)
    return str(info.value)


def _stalled_peers(rank: int, world: int) -> None:
    groups = [dist.new_group([0, 1]) for _ in "ABC"]  # collective: same order everywhere
    a, b = (_executor(rank, g, timeout_s=TIMEOUT) for g in groups[:2])
    assert _executor(rank, None).transport.timeout_s == DEFAULT_TIMEOUT_S == 300.0
    for executor in (a, b):  # a healthy first window: boundaries negotiated, no timeout
        _step(executor, rank)
    if rank == 1:  # pipeline A: rank 0 has stopped, stage 1 waits for its activations
        message = _times_out(a, rank)
        want = "rank 1: 1F2 waited 2 s for the activations from rank 0 (stage 0); the peer "
        assert message.startswith(want) and "raise timeout_s" in message, message
    else:  # pipeline B: rank 1 has stopped, stage 0 waits for its gradients
        message = _times_out(b, rank)
        want = "rank 0: 0B2 waited 2 s for the gradients from rank 1 (stage 1); the peer "
        assert message.startswith(want) and "check its log" in message, message
        message = _reducer_times_out(groups[2])
        want = "rank 0: REDUCE stage 0 waited 2 s for the all-reduce of its gradients with "
        assert message.startswith(want + "data-parallel rank 1; the peer "), message
    dist.barrier()  # rank 1 stays until rank 0's reduction has timed out


def test_a_stalled_peer_raises_a_named_timeout(tmp_path: Path) -> None:
    run_world(tmp_path, 2, _stalled_peers)
