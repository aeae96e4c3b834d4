"""Contiguous partition of blocks into pipeline stages that minimises the slowest stage.

The problem is PipeDream's (Narayanan et al., "PipeDream: Generalized Pipeline Parallelism
for DNN Training", SOSP 2019): cut an ordered list of layers into k contiguous stages so
that the largest stage time, which sets the pipeline's throughput, is smallest. torchgpipe
(Kim et al. 2020) balances the same way from profiled per-layer times ("balance by time").
Here stage i runs on device i with its own speed (heterogeneous clusters, as HetPipe), and
must fit its memory cap: static bytes (weights, gradients, optimizer state) plus
`inflight[i]` micro-batches of saved activations (1F1B holds k - i on stage i).

Solved exactly by dynamic programming over (stages, blocks), O(k·n²) in the worst case and
much less in practice (a candidate stage that is already slower than the best bottleneck
ends the scan). Limits: stage time is compute only (send time and tensor-parallel
collectives are not in the objective), and transient memory (recomputation's working set)
is not in the cap.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate, pairwise
from typing import TypeVar

from plait.cluster import Device
from plait.cost import BlockCost, DataDegrees, DataLayout, Optimizer, Recompute, expert_state_bytes
from plait.offload import offloaded_blocks
from plait.plan.minimax import Segment, minimax, minimax_blocks

__all__ = [
    "MemoryShortfall",
    "Partition",
    "blocks_fit",
    "partition",
    "partition_blocks",
]

_T = TypeVar("_T")
# `partition` through the generic `minimax` instead of its inlined form, for tests
REFERENCE = False
_ONE_RANK = DataDegrees()


@dataclass(frozen=True)
class Partition:
    """Stage s holds blocks boundaries[s] .. boundaries[s+1] - 1."""

    boundaries: tuple[int, ...]
    stage_times: tuple[float, ...]
    stage_memory: tuple[float, ...]

    @property
    def num_stages(self) -> int:
        return len(self.stage_times)

    @property
    def sizes(self) -> tuple[int, ...]:
        """Blocks per stage (torchgpipe's `balance`)."""
        return tuple(b - a for a, b in pairwise(self.boundaries))

    @property
    def bottleneck_s(self) -> float:
        return max(self.stage_times)

    @property
    def imbalance(self) -> float:
        """Slowest stage over the mean stage: 1.0 is perfect balance."""
        mean = sum(self.stage_times) / len(self.stage_times)
        return self.bottleneck_s / mean if mean > 0 else 1.0

    def split(self, items: Sequence[_T]) -> list[list[_T]]:
        """`items` (one per block) cut into stages."""
        return [list(items[a:b]) for a, b in pairwise(self.boundaries)]


def _prefix(values: Sequence[float]) -> list[float]:
    return list(accumulate(values, initial=0.0))


def _check_inputs(name: str, values: Sequence[float] | None, size: int, what: str) -> None:
    if values is None:
        return
    if len(values) != size:
        raise ValueError(f"{name} has {len(values)} entries; give one per {what} ({size})")
    bad = [v for v in values if not v >= 0]
    if bad:
        raise ValueError(f"{name} contains {bad[0]!r}; values must be >= 0")


def partition(
    times: Sequence[float],
    num_stages: int,
    *,
    speeds: Sequence[float] | None = None,
    static_bytes: Sequence[float] | None = None,
    activation_bytes: Sequence[float] | None = None,
    inflight: Sequence[int] | None = None,
    memory_caps: Sequence[float] | None = None,
    explain: bool = True,
) -> Partition:
    """The contiguous split of blocks with `times` (seconds at speed 1) into `num_stages`
    stages whose slowest stage, time / `speeds[i]`, is fastest, each stage within
    `memory_caps[i]` (static bytes + `inflight[i]` × activation bytes; `inflight` defaults
    to 1F1B's k - i). Raises ValueError when no split exists, naming the stage and excess
    (with `explain=False`, for callers that only ask whether one fits, without them)."""
    n, k = len(times), num_stages
    if k < 1:
        raise ValueError(f"num_stages={k} must be >= 1")
    if n < k:
        raise ValueError(
            f"num_stages={k} but only {n} blocks: use at most {n} stages or split blocks finer"
        )
    _check_inputs("times", times, n, "block")
    _check_inputs("static_bytes", static_bytes, n, "block")
    _check_inputs("activation_bytes", activation_bytes, n, "block")
    _check_inputs("speeds", speeds, k, "stage")
    _check_inputs("memory_caps", memory_caps, k, "stage")
    _check_inputs("inflight", inflight, k, "stage")
    for name, values in (("speeds", speeds), ("memory_caps", memory_caps)):
        if values is not None and min(values) <= 0:
            raise ValueError(f"{name}={list(values)} must all be > 0")
    time_sum, static_sum = _prefix(times), _prefix(static_bytes or [0.0] * n)
    act_sum = _prefix(activation_bytes or [0.0] * n)
    speed = list(speeds or [1.0] * k)
    held = list(inflight or [k - i for i in range(k)])
    caps = list(memory_caps or [math.inf] * k)

    def seconds(i: int, a: int, b: int) -> float:
        return (time_sum[b] - time_sum[a]) / speed[i]

    def memory(i: int, a: int, b: int) -> float:
        return static_sum[b] - static_sum[a] + held[i] * (act_sum[b] - act_sum[a])

    # prefix sums round differently from a stage's own sum: a split exactly at its cap fits
    limit = [c * (1 + 1e-12) for c in caps]
    if REFERENCE:
        cuts = minimax(n, k, seconds, lambda i, a, b: memory(i, a, b) <= limit[i])
    else:
        cuts = minimax_blocks(k, time_sum, speed, static_sum, act_sum, held, limit)
    if not cuts:
        if not explain:
            raise MemoryShortfall("no split fits the memory caps", stage=-1, excess_bytes=0.0)
        _raise_memory(n, k, memory, caps)
    pairs = list(pairwise(cuts))
    return Partition(
        boundaries=tuple(cuts),
        stage_times=tuple(seconds(i, a, b) for i, (a, b) in enumerate(pairs)),
        stage_memory=tuple(memory(i, a, b) for i, (a, b) in enumerate(pairs)),
    )


class MemoryShortfall(ValueError):
    """No split fits the memory caps; `excess_bytes` is how far the best one is over."""

    def __init__(self, message: str, *, stage: int, excess_bytes: float) -> None:
        super().__init__(message)
        self.stage = stage
        self.excess_bytes = excess_bytes


def _raise_memory(n: int, k: int, memory: Segment, caps: list[float]) -> None:
    """Explain infeasibility with the split that needs the least memory relative to caps."""
    cuts = minimax(n, k, lambda i, a, b: memory(i, a, b) / caps[i], lambda i, a, b: True)
    pairs = list(pairwise(cuts))
    stage = max(range(k), key=lambda i: memory(i, *pairs[i]) / caps[i])
    need = memory(stage, *pairs[stage])
    raise MemoryShortfall(
        f"no split of {n} blocks into {k} stages fits the memory caps: even the split that "
        f"needs least memory puts {need:.4g} bytes on stage {stage} (blocks "
        f"{pairs[stage][0]}..{pairs[stage][1] - 1}), whose cap is {caps[stage]:.4g}: "
        f"{need - caps[stage]:.4g} bytes over. Use more stages, recomputation, ZeRO, or "
        "devices with more memory",
        stage=stage,
        excess_bytes=need - caps[stage],
    )


@dataclass(frozen=True)
class _Inputs:
    """`partition`'s per-block and per-stage inputs for cost-model blocks on devices."""

    times: list[float]
    speeds: list[float]
    static_bytes: list[float]
    activation_bytes: list[float]
    memory_caps: list[float]


def _inputs(
    blocks: Sequence[BlockCost], devices: Sequence[Device], *, dtype: str, recompute: Recompute,
    layout: DataLayout, optimizer: Optimizer, offload_activations: str, offload_optimizer: bool,
) -> _Inputs:  # fmt: skip
    if not devices:
        raise ValueError("devices is empty: give one device per stage")
    work = [b.forward_flops + b.backward_input_flops + b.backward_weight_flops
            + b.recompute_flops(recompute) for b in blocks]  # fmt: skip
    static, saved, caps = _memory_inputs(
        blocks, devices, dtype=dtype, recompute=recompute, layout=layout, optimizer=optimizer,
        offload_activations=offload_activations, offload_optimizer=offload_optimizer,
    )  # fmt: skip
    return _Inputs(work, [d.achievable_flops(dtype) for d in devices], static, saved, caps)


def _memory_inputs(
    blocks: Sequence[BlockCost], devices: Sequence[Device], *, dtype: str, recompute: Recompute,
    layout: DataLayout, optimizer: Optimizer, offload_activations: str, offload_optimizer: bool,
) -> tuple[list[float], list[float], list[float]]:  # fmt: skip
    """(static bytes per block, saved bytes per block, memory cap per device)."""
    # a model's blocks are mostly alike: each parameter count's state is computed once
    states: dict[tuple[float, float], float] = {}
    static = []
    for b in blocks:
        key = (b.num_params, b.expert_params)
        if key not in states:
            x = expert_state_bytes(*key, layout=layout, dtype=dtype, optimizer=optimizer)
            states[key] = x.params + x.grads + (0.0 if offload_optimizer else x.optimizer)
        static.append(states[key])
    moved = offloaded_blocks(offload_activations, len(blocks))
    saved = [0.0 if i in moved else b.saved_for(recompute) for i, b in enumerate(blocks)]
    return static, saved, [float(d.memory_bytes) for d in devices]


def partition_blocks(
    blocks: Sequence[BlockCost],
    devices: Sequence[Device],
    *,
    dtype: str = "bf16",
    recompute: Recompute = "none",
    inflight: Sequence[int] | None = None,
    layout: DataLayout = _ONE_RANK,
    optimizer: Optimizer = "adam",
    offload_activations: str = "none",
    offload_optimizer: bool = False,
    explain: bool = True,
) -> Partition:
    """Partition cost-model blocks over `devices` (stage i on devices[i]): times from
    FLOPs (recomputation included) at each device's achievable rate, memory from model
    state and saved activations against each device's capacity (the model state of a rank
    of `layout`, a plan or `DataDegrees`, default one rank: ZeRO shards it over the dp
    ranks, expert state over the ranks holding the same experts). Offloaded activations
    (`plait.offload`) and optimizer state count nothing here: the simulator charges the
    block left on the device and the state swapped in for the step."""
    x = _inputs(
        blocks, devices, dtype=dtype, recompute=recompute, layout=layout, optimizer=optimizer,
        offload_activations=offload_activations, offload_optimizer=offload_optimizer,
    )  # fmt: skip
    return partition(
        x.times,
        len(devices),
        speeds=x.speeds,
        static_bytes=x.static_bytes,
        activation_bytes=x.activation_bytes,
        inflight=inflight,
        memory_caps=x.memory_caps,
        explain=explain,
    )


def blocks_fit(
    blocks: Sequence[BlockCost],
    devices: Sequence[Device],
    *,
    inflight: Sequence[int],
    dtype: str = "bf16",
    recompute: Recompute = "none",
    layout: DataLayout = _ONE_RANK,
    optimizer: Optimizer = "adam",
) -> bool:
    """Whether some contiguous cut of `blocks` over `devices`, stages allowed to be empty,
    fits each one's memory (as `partition_blocks` counts it), in one greedy pass: stage i
    takes as many blocks as it can hold. Taking more never leaves the later stages worse
    off (their rest is a suffix of any fitting cut's rest), so the pass is exact for such
    cuts; for the partitioner's cuts of non-empty stages it is a necessary condition only
    (False: none fits; True: `partition_blocks` decides)."""
    if not devices:
        raise ValueError("devices is empty: give one device per stage")
    static, saved, caps = _memory_inputs(
        blocks, devices, dtype=dtype, recompute=recompute, layout=layout, optimizer=optimizer,
        offload_activations="none", offload_optimizer=False,
    )  # fmt: skip
    n, start = len(blocks), 0
    for held, cap in zip(inflight, caps, strict=True):
        used = 0.0
        while start < n:
            need = static[start] + held * saved[start]
            if used + need > cap * (1 + 1e-12):
                break
            used += need
            start += 1
    return start == n
