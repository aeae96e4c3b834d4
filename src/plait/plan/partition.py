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
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import accumulate, pairwise
from typing import TypeVar

import numpy as np

from plait.cluster import Device
from plait.cost import BlockCost, DataDegrees, DataLayout, Optimizer, Recompute, expert_state_bytes
from plait.offload import offloaded_blocks

__all__ = [
    "MemoryShortfall",
    "Partition",
    "blocks_fit",
    "partition",
    "partition_blocks",
]

_T = TypeVar("_T")
Segment = Callable[[int, int, int], float]  # (stage, first block, end block) -> value
# `partition` through the generic `_minimax` instead of its inlined form, for tests
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


def _minimax(n: int, k: int, cost: Segment, fits: Callable[[int, int, int], bool]) -> list[int]:
    """Cut points minimising the largest `cost` of a stage, every stage `fits`; [] if none.

    Relies on `cost` and the failure of `fits` only growing as a segment grows."""
    inf = math.inf
    best = [[inf] * (n + 1) for _ in range(k + 1)]
    choice = [[-1] * (n + 1) for _ in range(k + 1)]
    best[0][0] = 0.0
    for i in range(1, k + 1):
        for j in range(i, n - (k - i) + 1):
            for start in range(j - 1, i - 2, -1):
                if not fits(i - 1, start, j):
                    break
                here = cost(i - 1, start, j)
                if here >= best[i][j]:
                    break
                value = max(best[i - 1][start], here)
                if value < best[i][j]:
                    best[i][j], choice[i][j] = value, start
    if best[k][n] == inf:
        return []
    cuts = [n]
    for i in range(k, 0, -1):
        cuts.append(choice[i][cuts[-1]])
    return cuts[::-1]


def _minimax_blocks(
    k: int,
    time_sum: list[float],
    speed: list[float],
    static_sum: list[float],
    act_sum: list[float],
    held: Sequence[float],
    limit: list[float],
) -> list[int]:
    """`_minimax` for `partition`'s own cost (seconds) and fit (memory within `limit`),
    inlined: the same comparisons on the same floats, so the same cuts, without two calls
    per candidate segment (the planner cuts hundreds of models of 100+ blocks)."""
    n = len(time_sum) - 1
    inf = math.inf
    best = [[inf] * (n + 1) for _ in range(k + 1)]
    choice = [[-1] * (n + 1) for _ in range(k + 1)]
    best[0][0] = 0.0
    arrays = [np.array(x) for x in (time_sum, static_sum, act_sum)]
    for i in range(1, k + 1):
        pace, hold, cap = speed[i - 1], held[i - 1], limit[i - 1]
        before, row, chosen = best[i - 1], best[i], choice[i]
        if n - k >= _BAND:  # many ends, long segments: every (end, start) at once
            _minimax_row(i, k, arrays, before, row, chosen, pace, hold, cap)
            continue
        for j in range(i, n - (k - i) + 1):
            t_end, s_end, a_end = time_sum[j], static_sum[j], act_sum[j]
            top = inf
            for start in range(j - 1, i - 2, -1):
                if not s_end - static_sum[start] + hold * (a_end - act_sum[start]) <= cap:
                    break
                here = (t_end - time_sum[start]) / pace
                if here >= top:
                    break
                value = before[start] if before[start] > here else here
                if value < top:
                    top, chosen[j] = value, start
            row[j] = top
    if best[k][n] == inf:
        return []
    cuts = [n]
    for i in range(k, 0, -1):
        cuts.append(choice[i][cuts[-1]])
    return cuts[::-1]


# from this many more blocks than stages, `_minimax_blocks` prices its rows over arrays
_BAND = 16


def _minimax_row(
    i: int,
    k: int,
    arrays: list[np.ndarray],
    before: list[float],
    row: list[float],
    chosen: list[int],
    pace: float,
    hold: float,
    cap: float,
) -> None:
    """Row i of `_minimax_blocks` over arrays: for each end, the latest start of the least
    max(before[start], stage seconds) among starts whose stage fits (the scan's answer)."""
    time_sum, static_sum, act_sum = arrays
    n = len(time_sum) - 1
    ends = np.arange(i, n - (k - i) + 1)[:, None]
    starts = np.arange(i - 1, n - (k - i))[None, :]
    seconds = (time_sum[ends] - time_sum[starts]) / pace
    memory = static_sum[ends] - static_sum[starts] + hold * (act_sum[ends] - act_sum[starts])
    value = np.maximum(np.array(before)[starts], seconds)
    value[~((starts < ends) & (memory <= cap))] = math.inf
    last = value.shape[1] - 1 - value[:, ::-1].argmin(axis=1)  # the latest of the least
    least = value[np.arange(len(last)), last]
    for j, top, start in zip(ends[:, 0].tolist(), least.tolist(), last.tolist(), strict=True):
        row[j] = top
        if top < math.inf:
            chosen[j] = start + i - 1


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
        cuts = _minimax(n, k, seconds, lambda i, a, b: memory(i, a, b) <= limit[i])
    else:
        cuts = _minimax_blocks(k, time_sum, speed, static_sum, act_sum, held, limit)
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
    cuts = _minimax(n, k, lambda i, a, b: memory(i, a, b) / caps[i], lambda i, a, b: True)
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
