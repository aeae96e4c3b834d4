"""Data-parallel gradient averaging: bucketed all-reduces overlapped with the last backward.

Why not DDP: DDP reduces inside `loss.backward()` of a module it wraps, but a pipeline
stage runs one backward per micro-batch through `torch.autograd.backward` on its outputs
(and, with zero-bubble schedules, the weight gradients in a separate pass). The executor
knows which backward action of a stage completes the gradients of its next update; only
during that one does this reducer listen: a post-accumulate-grad hook counts each
parameter in, and a bucket (parameters in reverse registration order, about `bucket_bytes`
each, as in DDP, Li et al. VLDB 2020) is all-reduced asynchronously the moment it is
complete, while the backward goes on. The stage's REDUCE launches what is left (buckets
whose gradients were computed on a weight copy, which hooks on the live parameters never
see); `finish` waits for the buckets and writes the averages back, at most `timeout_s`
per bucket: a replica that stalls makes it raise `PipelineTimeout` naming ``REDUCE stage
s`` instead of hanging.

Tensor-parallel parameters (DTensor) are reduced through their local shards: data
parallel replicas of one shard live on the dp axis, so averaging shards is averaging the
gradient.

A communication hook (`hook(state, bucket) -> Future`, DDP's protocol; see
`plait.parallel.compress`) replaces the plain all-reduce of every bucket when given: it
receives the bucket's summed local gradients, not yet divided, and its future yields the
average, as under DDP.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from plait.parallel.compress import HookBucket
from plait.wait import (
    DEFAULT_TIMEOUT_S,
    PipelineTimeout,
    check_timeout,
    timed_wait,
    timeout_message,
)

__all__ = ["GradReducer"]


def _local(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None else t


@dataclass
class _Bucket:
    params: list[nn.Parameter]
    group: Any = None  # the process group its parameters are averaged over
    world: float = 1  # the divisor: its group's size (÷ `group_scale` for other groups)
    index: int = 0  # unique over the reducer's stages: a hook's state is keyed by it
    ready: int = 0
    queued: bool = False  # complete, waiting for its hook (hooks run at `finish`)
    flat: torch.Tensor | None = None
    work: Any = None
    # plain-tensor buckets keep one buffer whose slices are the parameters' gradients
    # (DDP's gradient_as_bucket_view): autograd accumulates into it, nothing is copied
    storage: torch.Tensor | None = None
    views: list[torch.Tensor] | None = None

    def attach(self) -> None:
        """Make each gradient a slice of the bucket's buffer (plain tensors of one dtype)."""
        if any(hasattr(p, "to_local") for p in self.params):
            return
        if len({(p.dtype, p.device) for p in self.params}) != 1:
            return
        first = self.params[0]
        self.storage = torch.zeros(
            sum(p.numel() for p in self.params), dtype=first.dtype, device=first.device
        )
        self.views, offset = [], 0
        for p in self.params:
            self.views.append(self.storage[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
        self.zero()

    def zero(self) -> None:
        if self.storage is None or self.views is None:
            for p in self.params:
                p.grad = None
            return
        self.storage.zero_()
        for p, view in zip(self.params, self.views, strict=True):
            p.grad = view

    def attached(self) -> bool:
        """Whether every gradient is still its slice of the buffer."""
        return self.views is not None and all(
            p.grad is v for p, v in zip(self.params, self.views, strict=True)
        )


@dataclass
class _StageBuckets:
    buckets: list[_Bucket]
    bucket_of: dict[int, _Bucket] = field(default_factory=dict)
    armed: bool = False


class GradReducer:
    """Averages the gradients of each stage's parameters over the data-parallel `group`;
    a wait for a reduction longer than `timeout_s` seconds raises `PipelineTimeout`.

    `param_groups` gives some parameters another group (expert parameters: the ranks that
    hold the same experts, `plait.mesh.Meshes.expert_dp_group`); each is averaged over its
    own group (divided by that group's size), in buckets that never mix groups, and then
    multiplied by `group_scale` (expert parameters: `plait.parallel.experts.
    expert_grad_scale`, so that they are summed over their replicas and divided by dp).
    A communication `hook` (gradient compression) reduces the buckets of `group` only:
    its state holds that group; the other groups' buckets are all-reduced uncompressed.
    """

    def __init__(
        self,
        stage_params: dict[int, list[nn.Parameter]],
        group: dist.ProcessGroup,
        *,
        param_groups: Mapping[nn.Parameter, dist.ProcessGroup] | None = None,
        group_scale: float = 1.0,
        bucket_bytes: int = 25 * 2**20,
        timeout_s: float | None = DEFAULT_TIMEOUT_S,
        hook: Any = None,
        hook_state: Any = None,
    ) -> None:
        self.group, self.timeout_s = group, check_timeout(timeout_s)
        self.hook, self.hook_state = hook, hook_state
        # torch's fp16/bf16 hooks issue their one all-reduce at once and only cast in the
        # future's callback: safe to launch as each bucket completes, overlapped with the
        # backward as DDP does; other hooks run in bucket order at `finish` (see there)
        self._eager = hook is not None and hook in _eager_hooks()
        self.world = dist.get_world_size(group)
        chosen = {id(p): g for p, g in (param_groups or {}).items()}
        self._count = 0
        self.stages: dict[int, _StageBuckets] = {}
        self._launched: dict[int, list[_Bucket]] = {}
        for stage, params in stage_params.items():
            trainable = [p for p in params if p.requires_grad]
            buckets = []
            # a small first bucket pays only where reductions overlap the backward; hooks
            # run at `finish` one bucket at a time, where each bucket costs a round trip
            overlap = hook is None or self._eager
            first = min(bucket_bytes, _FIRST_BUCKET_BYTES) if overlap else bucket_bytes
            for g, members in _by_group(list(reversed(trainable)), chosen, group):
                for bucket in _make_buckets(members, bucket_bytes, first):
                    scale = 1.0 if g is group else group_scale
                    bucket.group, bucket.world = g, dist.get_world_size(g) / scale
                    buckets.append(bucket)
            state = _StageBuckets(buckets)
            for bucket in buckets:
                bucket.index, self._count = self._count, self._count + 1
                bucket.attach()
                for p in bucket.params:
                    state.bucket_of[id(p)] = bucket
                    p.register_post_accumulate_grad_hook(self._hook(stage, state))  # type: ignore[no-untyped-call]
            self.stages[stage] = state
            self._launched[stage] = []
        # the last bucket the hook sees (PowerSGD counts steps by it)
        hooked = [b.index for st in self.stages.values() for b in st.buckets if self._hooked(b)]
        self._last_hooked = max(hooked, default=-1)

    def _hooked(self, bucket: _Bucket) -> bool:
        """Whether the hook reduces `bucket`: only over the main group (a hook's state
        holds its group); other groups' buckets (experts') are reduced uncompressed."""
        return self.hook is not None and bucket.group is self.group

    def _hook(self, stage: int, state: _StageBuckets) -> Any:
        # the hook lives on the parameter, in C++ where the collector cannot follow it, and
        # the buckets hold the parameters: strong references here would keep the reducer,
        # its parameters and its groups alive after the engine (each tensor-parallel engine
        # of a sweep left a gloo group and its threads behind)
        reducer, buckets = weakref.ref(self), weakref.ref(state)

        def on_grad(p: torch.Tensor) -> None:
            me, mine = reducer(), buckets()
            if me is None or mine is None or not mine.armed:
                return
            bucket = mine.bucket_of[id(p)]
            bucket.ready += 1
            if bucket.ready == len(bucket.params):
                me._launch(stage, bucket)

        return on_grad

    def bucket_sizes(self) -> dict[int, int]:
        """Entries of every bucket, by index (a hook state's residuals have these sizes)."""
        return {
            b.index: sum(_local(p).numel() for p in b.params)
            for state in self.stages.values()
            for b in state.buckets
        }

    def bucket_shapes(self) -> dict[int, list[list[int]]]:
        """Each bucket's local parameter shapes, by index (PowerSGD's factors follow them)."""
        return {
            b.index: [list(_local(p).shape) for p in b.params]
            for state in self.stages.values()
            for b in state.buckets
        }

    def before_backward(self, stage: int, *, last: bool) -> None:
        if last:
            state = self.stages[stage]
            state.armed = True
            for bucket in state.buckets:
                bucket.ready = 0

    def after_backward(self, stage: int, *, last: bool) -> None:
        if last:
            self.stages[stage].armed = False

    def reduce(self, stage: int) -> None:
        """Launch every bucket of `stage` not launched during its last backward (their
        parameters got no gradient then, or computed on a weight copy)."""
        for bucket in self.stages[stage].buckets:
            if bucket.work is None and bucket.flat is None and not bucket.queued:
                self._launch(stage, bucket)

    def zero_grad(self, stage: int | None = None) -> None:
        """Zero the gradients (in place where they are views of a bucket)."""
        for s in self._chosen(stage):
            for bucket in self.stages[s].buckets:
                bucket.zero()

    def _chosen(self, stage: int | None) -> list[int]:
        return list(self.stages) if stage is None else [stage]

    def _launch(self, stage: int, bucket: _Bucket) -> None:
        if self._hooked(bucket) and self._eager:  # launched now, as a plain all-reduce is
            bucket.work = self._hook_future(bucket)
            self._launched[stage].append(bucket)
            return
        if self._hooked(bucket):  # run at `finish`, one bucket at a time (see there)
            bucket.queued = True
            self._launched[stage].append(bucket)
            return
        if bucket.attached():
            assert bucket.storage is not None
            bucket.flat = bucket.storage.div_(bucket.world)
            bucket.work = dist.all_reduce(bucket.flat, group=bucket.group, async_op=True)
            self._launched[stage].append(bucket)
            return
        grads = []
        for p in bucket.params:
            g = p.grad
            grads.append(torch.zeros_like(_local(p)) if g is None else _local(g))
        bucket.flat = torch.cat([g.reshape(-1) for g in grads]).div_(bucket.world)
        bucket.work = dist.all_reduce(bucket.flat, group=bucket.group, async_op=True)
        self._launched[stage].append(bucket)

    def _hook_future(self, bucket: _Bucket) -> Any:
        """Hand the bucket's summed gradients to the hook (PowerSGD and the like need them
        undivided and shaped per parameter: `HookBucket`); its future yields the average."""
        if bucket.attached():
            assert bucket.storage is not None
            flat = bucket.storage
        else:
            grads = [torch.zeros_like(_local(p)) if p.grad is None else _local(p.grad)
                     for p in bucket.params]  # fmt: skip
            flat = torch.cat([g.reshape(-1) for g in grads])
        shapes = [_local(p).shape for p in bucket.params]
        last = bucket.index == self._last_hooked  # once per step: PowerSGD counts steps by it
        view = HookBucket(bucket.index, flat, shapes, bucket.params, last=last)
        return self.hook(self.hook_state, view)

    def finish(self, stage: int | None = None) -> None:
        """Wait for every bucket's reduction and write the averages back. With a hook other
        than fp16/bf16 the buckets are reduced here, in bucket order and one at a time: a
        hook may issue collectives from its futures' callbacks (PowerSGD does), on another
        thread, and gloo needs every rank to issue them in the same order (DDP with
        PowerSGD and several buckets on gloo fails with a size mismatch)."""
        for s in self._chosen(stage):
            self.reduce(s)
            if self.hook is not None and not self._eager:
                self._launched[s].sort(key=lambda b: b.index)
            for bucket in self._launched[s]:
                explain = functools.partial(self._explain, s)
                if self._hooked(bucket) and self._eager:
                    bucket.flat = _wait_future(bucket.work, explain)
                elif self._hooked(bucket):
                    future = self._hook_future(bucket)
                    bucket.flat, bucket.queued = _wait_future(future, explain), False
                else:
                    timed_wait(bucket.work, self.timeout_s, explain)
                assert bucket.flat is not None
                if bucket.flat is bucket.storage:  # the gradients are the buffer's slices
                    bucket.flat, bucket.work = None, None
                    continue
                offset = 0
                for p in bucket.params:
                    n = _local(p).numel()
                    chunk = bucket.flat[offset : offset + n].view_as(_local(p))
                    if p.grad is None:
                        p.grad = _wrap_like(p, chunk.clone())
                    else:
                        _local(p.grad).copy_(chunk)
                    offset += n
                bucket.flat, bucket.work = None, None
            self._launched[s].clear()

    def _explain(self, stage: int) -> str:
        """Why the wait for `stage`'s reduction timed out."""
        assert self.timeout_s is not None
        me = dist.get_rank()
        others = [r for r in dist.get_process_group_ranks(self.group) if r != me]
        ranks = ("ranks " if len(others) > 1 else "rank ") + ", ".join(map(str, others))
        awaited = f"the all-reduce of its gradients with data-parallel {ranks}"
        return timeout_message(
            f"rank {me}", f"REDUCE stage {stage}", self.timeout_s, awaited, peers=len(others)
        )


def _eager_hooks() -> tuple[Any, ...]:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return (default_hooks.fp16_compress_hook, default_hooks.bf16_compress_hook)


def _wait_future(future: torch._C.Future[Any], explain: Any) -> torch.Tensor:
    """A hook's result. Its collectives are bounded by the process group's timeout (which
    `plait train --timeout` sets); their expiry becomes the same `PipelineTimeout`."""
    try:
        value = future.wait()
    except RuntimeError as error:
        if "timed out" not in str(error).lower():
            raise
        raise PipelineTimeout(explain()) from error
    return value[0] if isinstance(value, list) else value


def _wrap_like(p: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """A gradient for `p` from its local values (a DTensor when `p` is one)."""
    if hasattr(p, "to_local"):
        from torch.distributed.tensor import DTensor

        assert isinstance(p, DTensor)
        return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False)
    return local


def _by_group(
    params: list[nn.Parameter], chosen: dict[int, Any], default: Any
) -> list[tuple[Any, list[nn.Parameter]]]:
    """`params` split by reduction group, each keeping their order; the default group
    first, so that with one group the buckets are exactly those of one list."""
    groups: dict[int, tuple[Any, list[nn.Parameter]]] = {id(default): (default, [])}
    for p in params:
        g = chosen.get(id(p), default)
        groups.setdefault(id(g), (g, []))[1].append(p)
    return [(g, members) for g, members in groups.values() if members]


_FIRST_BUCKET_BYTES = 2**20  # DDP's: the last layers' gradients leave while the rest compute


def _make_buckets(
    params: list[nn.Parameter], bucket_bytes: int, first_bytes: int | None = None
) -> list[_Bucket]:
    """Buckets of about `bucket_bytes`, the first (the gradients computed first) of about
    `first_bytes`, as DDP cuts them (1 MiB): a small first bucket starts communicating
    while the backward goes on."""
    buckets: list[_Bucket] = []
    current: list[nn.Parameter] = []
    size = 0
    for p in params:
        current.append(p)
        size += _local(p).numel() * _local(p).element_size()
        if size >= (bucket_bytes if buckets or first_bytes is None else first_bytes):
            buckets.append(_Bucket(current))
            current, size = [], 0
    if current:
        buckets.append(_Bucket(current))
    return buckets
