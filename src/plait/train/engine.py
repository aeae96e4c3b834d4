"""`parallelize`: one model, one plan, and an engine that trains under it window by window.

The order of construction follows torchtitan's: cut the model into this rank's pipeline
stages, shard them for tensor parallelism, wrap blocks for recomputation, shard them
for ZeRO-2/3, then build one optimizer per stage over what remains local. The engine owns
nothing the layers below do not already offer; it wires them together. Each window (one
`step`) runs the rank's program, which holds the optimizer steps (`UPDATE`) itself:

    per micro-batch forward/backward -> each stage's gradient reduction launched during
    its last backward (REDUCE) -> at the UPDATE of a stage: wait for its reduction, fp16
    unscale and inf check, gradient-norm clipping, the stage's optimizer step

For a synchronous schedule the inf check and the clipping are global (all stages of the
model, all workers), done once per window at the first UPDATE every rank reaches after
all its backwards, and the gradients stay in `.grad` until the next step, as in a plain
training loop. An asynchronous schedule updates each stage on its own, from different
micro-batches than the other stages at the same moment: there is no global gradient to
clip, so each stage clips its own gradient's norm, and fp16 loss scaling (which needs a
global inf check per update) is refused; bf16 needs none.

Host reads. The clipped norm and fp16's found-inf flag stay tensors on the device until
the window ends, where they are read in the same copy as the window's losses
(`_Losses.exchange`): one host read per step for fp32 and bf16 on any device, and for
fp16 when every stage's optimizer takes the flag itself (torch's fused AdamW/Adam/SGD,
`optimizer_impl` auto's choice: it skips the update on the device, as
`torch.amp.GradScaler.step` has it do). fp16 with any other optimizer (foreach or loop;
ZeRO-1's `ZeroRedundancyOptimizer`; fused SGD before its momentum exists) reads the flag
once more, at the window's first UPDATE, before stepping. The waits of the executor's
transport and of the reducers, evaluation, and an asynchronous schedule's loss exchange
(read windows later) are outside this count. The loss scale and the learning-rate
schedules of a step whose skip is decided on the device change when the flag is read.
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from plait.checkpoint.state import block_names
from plait.compat import pytree
from plait.config import ParallelPlan
from plait.device import autocast_context
from plait.device import current as current_device
from plait.mesh import Meshes, ParallelDims
from plait.parallel import (
    FSDPGradSync,
    GradReducer,
    apply_fsdp,
    apply_tensor_parallel,
    clip_grad_norm,
    expert_grad_scale,
    expert_params,
    shard_experts,
)
from plait.parallel.compress import hook_for
from plait.parallel.replicas import uncounted_params, with_replicas
from plait.parallel.sync import GradSync
from plait.runtime import PipelineExecutor, StepResult, local_stages, split_microbatches
from plait.runtime.backend import MetricFn
from plait.runtime.channels import Channels, build_channels
from plait.runtime.predict import optimizer_predictor
from plait.runtime.transport import DEFAULT_TIMEOUT_S, timed_wait, timeout_message
from plait.schedule import Schedule, build
from plait.train.arguments import check_parallelize_arguments
from plait.train.compile import apply_compile, check_compile
from plait.train.offload import apply_offload
from plait.train.precision import LossScaler, skips_on_device, step_unless_found
from plait.train.recompute import apply_recompute

__all__ = ["Engine", "EvalReport", "StepReport", "parallelize"]

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
# (a stage's optimizer, optimizer updates per window) -> its learning-rate schedule
SchedulerFactory = Callable[[torch.optim.Optimizer, int], torch.optim.lr_scheduler.LRScheduler]
LossFn = Callable[[Any, Any], torch.Tensor]


@dataclass(frozen=True)
class StepReport:
    """One window (one training step), as every rank sees it."""

    # the mean loss of the micro-batches it reports (NaN if none): those the window
    # finished; for an asynchronous schedule those finished `reach + 1` windows earlier
    # (their exchange overlaps the later windows instead of stalling the pipeline), and
    # the drain reports the rest
    loss: float
    skipped: bool  # fp16 found an inf/NaN gradient somewhere and skipped the update
    grad_norm: float | None  # the global norm clipped to (synchronous schedules)
    result: StepResult  # this rank's executor record (timeline, its micro-batch losses)
    losses: tuple[float, ...] = ()  # per micro-batch reported, in order of global id
    microbatches: tuple[int, ...] = ()  # their global ids
    updates: int = 1  # optimizer steps this rank's (first) stage took


@dataclass(frozen=True)
class EvalReport:
    """A forward-only pass over one batch, as every rank sees it."""

    loss: float  # mean over the batch's samples of the loss, as in training
    metrics: dict[str, float]  # each metric's sum over the samples / samples
    samples: int
    # an asynchronous stream had to be drained first: that drain's report (its losses
    # and updates belong to training), else None
    drained: StepReport | None = None


class Engine:
    """Trains this rank's share of a model under a `ParallelPlan`. Build with `parallelize`."""

    def __init__(
        self,
        *,
        plan: ParallelPlan,
        mesh: DeviceMesh,
        schedule: Schedule,
        stages: dict[int, nn.Module],
        optimizers: dict[int, torch.optim.Optimizer],
        grad_sync: GradSync | None,
        loss_fn: LossFn,
        device: torch.device,
        grad_clip: float | None,
        block_names: list[str] | None = None,
        timeout_s: float | None = DEFAULT_TIMEOUT_S,
        schedulers: dict[int, torch.optim.lr_scheduler.LRScheduler] | None = None,
        meshes: Meshes | None = None,
        channels: Channels | None = None,
    ) -> None:
        self.plan, self.mesh, self.schedule = plan, mesh, schedule
        # with the expert view (ep > 1): the ep group exchanges tokens, and its ranks hold
        # different experts (`ep_params`), whose squared gradient norms add up over it
        self.meshes = meshes or Meshes(main=mesh)
        self.ep_group = self.meshes.ep_group()
        self.ep_params = [p for s in stages.values() for p in expert_params(s)]
        # stepped after each update of their stage's optimizer (not after a skipped one)
        self.schedulers = schedulers or {}
        self.timeout_s = timeout_s  # for every wait on a peer (plait.runtime.transport)
        # each block's name in the whole model: checkpoints name parameters by it
        self.block_names = block_names or []
        self.stages, self.optimizers = stages, optimizers
        self.grad_sync, self.device, self.grad_clip = grad_sync, device, grad_clip
        self.params = [p for s in stages.values() for p in s.parameters() if p.requires_grad]
        self.uncounted = uncounted_params(schedule, stages)  # replicas: a part counts once
        self.scaler = LossScaler() if plan.dtype == "fp16" else None
        self.dp_index = mesh.get_local_rank("dp")
        self.synchronous = schedule.policy == "sync"
        self.executor = PipelineExecutor(
            schedule,
            stages,
            rank=mesh.get_local_rank("pp"),
            loss_fn=loss_fn,
            group=mesh.get_group("pp"),
            channels=channels,
            device=device,
            grad_sync=grad_sync,
            forward_context=autocast_context(plan.dtype, device),
            updater=self._update,
            predictor=optimizer_predictor(optimizers) if schedule.policy == "predict" else None,
            timeout_s=timeout_s,
        )
        self._prepared: int | None = None  # the version whose global checks ran
        # this window's fp16 found-inf flag and clipped norm, read on the host at its end
        self._found_inf: torch.Tensor | None = None
        self._norm: torch.Tensor | None = None
        self._skip_read: bool | None = None  # the flag, where an optimizer needed it early
        self._deferred: list[int] = []  # stages whose lr schedule waits for the flag
        self._losses = _Losses(self)

    # ------------------------------------------------------------------ steps
    def step(self, batch: tuple[Any, Any]) -> StepReport:
        """One window on the global `batch` = (inputs, targets); every rank may pass the
        same batch; each dp rank trains on its own slice of dim 0, in m micro-batches."""
        inputs, targets = batch
        m = self.plan.microbatches
        micro_in = (
            split_microbatches(_to(self._shard(inputs), self.device), m)
            if self.executor.needs_inputs
            else None
        )
        micro_tg = (
            split_microbatches(_to(self._shard(targets), self.device), m)
            if self.executor.needs_targets
            else None
        )
        return self._window(micro_in, micro_tg)

    def drain(self) -> StepReport:
        """Finish every micro-batch begun (an asynchronous pipeline's drain; a synchronous
        one has nothing left). Call once, after the last step."""
        result = self.executor.drain()
        return self._report(result, last=True)

    def restart(self) -> None:
        """Start a new stream after `drain` (an asynchronous schedule's next step begins
        with a warm-up again)."""
        self.executor.restart()
        self._prepared = None

    def run(self, microbatches: Iterable[tuple[Any, Any]]) -> Iterator[StepReport]:
        """Train on a stream of global micro-batches (inputs, targets), each of dp × the
        micro-batch size (dp rank r takes slice r): a window per m of them, warm-up, steady
        state and drain. Yields a report per window, then the drain's."""
        m, window, count = self.plan.microbatches, [], 0
        for count, (inputs, targets) in enumerate(microbatches, start=1):  # noqa: B007
            window.append(
                (_to(self._shard(inputs), self.device), _to(self._shard(targets), self.device))
            )
            if len(window) == m:
                ins = [x for x, _ in window] if self.executor.needs_inputs else None
                tgs = [y for _, y in window] if self.executor.needs_targets else None
                yield self._window(ins, tgs)
                window = []
        if window:
            raise ValueError(
                f"the stream ended {len(window)} micro-batches into a window of {m} "
                f"(after {count}): give a multiple of microbatches={m}"
            )
        yield self.drain()

    def evaluate(
        self, batch: tuple[Any, Any], metrics: dict[str, MetricFn] | None = None
    ) -> EvalReport:
        """The loss (and `metrics`, each returning a sum over a micro-batch's samples) of the
        global `batch` = (inputs, targets) of any size, by a forward-only pass through the
        pipeline on the newest weights: no gradient, no update. Each data-parallel replica
        takes an equal share (the first one also the `size % dp` left over), cut into at
        most `microbatches` micro-batches, equal but the last (`_eval_parts`); no sample is
        dropped or counted twice. An asynchronous stream in flight is
        drained first and restarted after (as a checkpoint save does), so its later windows
        begin with a warm-up again; the drain's report is returned."""
        drained = None
        if not self.synchronous and self.executor.windows and not self.executor.stream.drained:
            drained = self.drain()
        inputs, targets = batch
        values: torch.Tensor | None = None
        size, dp, m = _batch_size(targets), self.plan.dp, self.plan.microbatches
        parts = _eval_parts(size, dp, self.dp_index, m)
        for k, (first, count, each, counted) in enumerate(parts):
            starts = [first + i * each for i in range(count)]
            micro_in = micro_tg = None
            if self.executor.needs_inputs:
                micro_in = [_to(_rows(inputs, at, each), self.device) for at in starts]
            if self.executor.needs_targets:
                micro_tg = [_to(_rows(targets, at, each), self.device) for at in starts]
            # every replica runs these programs in this order (ZeRO-3 gathers weights in
            # each forward and each boundary probe), keyed alike: shapes are described
            # anew on all replicas at once, or on none
            found = self.executor.evaluate(
                micro_in,
                micro_tg,
                metrics or {},
                count=count,
                agreed=(k, size, dp, m),
            )
            sums = found.values * counted
            values = sums if values is None else values + sums
        names = tuple(metrics or {})
        if values is None:  # an empty batch
            values = torch.zeros(2 + len(names), device=self.device, dtype=torch.float64)
        values = values / self.plan.tp  # tp replicas of a last stage count once
        dist.all_reduce(values)
        if drained is not None:
            self.restart()
        samples = max(1.0, float(values[1]))
        return EvalReport(
            loss=float(values[0] / samples),
            metrics={n: float(v / samples) for n, v in zip(names, values[2:], strict=True)},
            samples=round(float(values[1])),
            drained=drained,
        )

    def _window(self, micro_in: list[Any] | None, micro_tg: list[Any] | None) -> StepReport:
        if self.synchronous:  # the last step's gradients stayed readable until now
            self._zero_grad()
        scale = self.scaler.scale if self.scaler is not None else 1.0
        result = self.executor.step(micro_in, micro_tg, loss_scale=scale)
        return self._report(result)

    def _shard(self, value: Any) -> Any:
        """This dp rank's slice of a global batch (dim 0)."""
        if self.plan.dp == 1:
            return value
        return split_microbatches(value, self.plan.dp)[self.dp_index]

    # ---------------------------------------------------------------- updates
    def _update(self, stage: int, version: int) -> None:
        """The optimizer step of `stage` (an UPDATE action), producing `version`."""
        if self.synchronous:
            if self._prepared != version:  # the first update this window: global checks
                self._prepared = version
                self._check_all()
        else:
            self._clip_stage(stage)
        self._step(stage)
        if not self.synchronous:  # the stage's next backward comes before the window ends
            self._zero_grad(stage)

    def _step(self, stage: int) -> None:
        """`stage`'s optimizer step, unless fp16 found an inf: skipped on the device by an
        optimizer that takes the flag, else after one host read of it per window."""
        optimizer, found = self.optimizers[stage], self._found_inf
        if found is not None and skips_on_device(optimizer):
            step_unless_found(optimizer, found)
            self._deferred.append(stage)  # the schedule steps once the flag is read
            return
        if found is not None and self._skip_read is None:
            self._skip_read = bool(found.item())
        if not self._skip_read:
            optimizer.step()
            if stage in self.schedulers:
                self.schedulers[stage].step()

    def _zero_grad(self, stage: int | None = None) -> None:
        for s, optimizer in self.optimizers.items():
            if stage is None or s == stage:
                optimizer.zero_grad(set_to_none=True)
        if self.grad_sync is not None:  # after the optimizer: keeps bucket views alive
            self.grad_sync.zero_grad(stage)

    def _check_all(self) -> None:
        """Wait for every reduction, unscale and check fp16 gradients everywhere, clip the
        global norm; the flag and the norm stay on the device (`_flags`)."""
        if self.grad_sync is not None:
            self.grad_sync.finish()
        if self.scaler is not None:
            self._found_inf = self.scaler.unscale_(self.params, self.device)
        if self.grad_clip is not None:
            self._norm = clip_grad_norm(self.params, self.grad_clip, pp_group=self._pp_group,
                                        ep_group=self.ep_group, ep_params=self.ep_params,
                                        uncounted=self.uncounted)  # fmt: skip

    def _clip_stage(self, stage: int) -> None:
        if self.grad_sync is not None:
            self.grad_sync.finish(stage)
        if self.grad_clip is not None:  # its norm is not reported: never read
            params = [p for p in self.stages[stage].parameters() if p.requires_grad]
            clip_grad_norm(params, self.grad_clip, pp_group=None, ep_group=self.ep_group,
                           ep_params=self.ep_params)  # fmt: skip

    def _flags(self) -> list[torch.Tensor]:
        """What the host reads with the window's losses: the found-inf flag and the
        clipped norm, each where this window has one."""
        return [t for t in (self._found_inf, self._norm) if t is not None]

    def _settle(self, values: list[float]) -> tuple[bool, float | None]:
        """`_flags`'s values, read: (the step was skipped, the norm it reports). Updates the
        loss scale and steps the schedules whose step waited for the flag."""
        read = iter(values)
        skipped = self._found_inf is not None and next(read) > 0
        norm = next(read) if self._norm is not None else None
        if self.scaler is not None and self._found_inf is not None:
            self.scaler.update(skipped)
        for stage in self._deferred if not skipped else []:
            if stage in self.schedulers:
                self.schedulers[stage].step()
        self._found_inf = self._norm = self._skip_read = None
        self._deferred = []
        return skipped, None if skipped or not self.synchronous else norm

    # ---------------------------------------------------------------- reports
    @property
    def _pp_group(self) -> dist.ProcessGroup:
        return self.mesh.get_group("pp")

    def _report(self, result: StepResult, *, last: bool = False) -> StepReport:
        ids, losses, flags = self._losses.exchange(
            self.executor.windows, result, last=last, extra=self._flags()
        )
        skipped, norm = self._settle(flags)
        loss = sum(losses) / len(losses) if losses else float("nan")
        return StepReport(loss, skipped, norm, result, losses, ids, result.updates)


class _Losses:
    """Every finished micro-batch's global id and loss, on every rank. Only the ranks of
    last stages have them: one all-reduce over all workers sums them (each tensor- and
    data-parallel replica counts 1/(dp·tp), so data-parallel losses are averaged).

    A synchronous window's losses are exchanged at its end (its UPDATEs synchronised the
    workers anyway). An asynchronous stream must not wait: its stages run windows apart,
    so a window's reduction is started at its end and collected `lag` windows later (or
    at the drain), when every worker has long passed that window.
    """

    def __init__(self, engine: Engine) -> None:
        plan, schedule = engine.plan, engine.schedule
        self.device, self.m, self.reach = engine.device, plan.microbatches, schedule.reach
        self.weight = 1.0 / (plan.dp * plan.tp)
        self.timeout_s = engine.timeout_s
        self.lag = 0 if engine.synchronous else schedule.reach + 1
        self.pending: deque[tuple[int, Any, torch.Tensor, int]] = deque()
        self.reduced = dist.get_world_size() > 1

    def exchange(
        self, windows: int, result: StepResult, *, last: bool, extra: Sequence[torch.Tensor] = ()
    ) -> tuple[tuple[int, ...], tuple[float, ...], list[float]]:
        """Start the reduction of `result`'s losses (after `windows` windows); return the
        losses whose reduction is due now (all of them when `last`), and the values of the
        `extra` tensors (one element each), read in the same copy to the host."""
        first = (windows - 1 - self.reach) * self.m  # ids span the window and `reach` before
        span = (self.reach + 1) * self.m
        values = torch.zeros(2 * span, device=self.device)
        for x, loss in zip(result.microbatches, result.losses, strict=True):
            values[x - first] = loss.to(self.device) * self.weight
            values[span + x - first] = self.weight
        # one worker holds every loss already (a collective of one still costs milliseconds)
        work = dist.all_reduce(values, async_op=True) if self.reduced else None
        self.pending.append((windows, work, values, first))
        due: list[tuple[torch.Tensor, int]] = []
        while self.pending and (last or self.pending[0][0] <= windows - self.lag):
            started, work, values, first = self.pending.popleft()
            if work is not None:
                timed_wait(work, self.timeout_s, functools.partial(self._explain, started))
            due.append((values, first))
        parts = [v for v, _ in due] + [t.reshape(1).to(self.device, torch.float32) for t in extra]
        host = torch.cat(parts).tolist() if parts else []  # the step's one host read
        found: list[tuple[int, float]] = []
        for k, (_, first) in enumerate(due):
            row = host[2 * span * k : 2 * span * (k + 1)]
            found += [(first + i, v) for i, (v, c) in enumerate(zip(row[:span], row[span:],
                      strict=True)) if c > 0.5]  # fmt: skip
        rest = host[2 * span * len(due) :]
        return tuple(x for x, _ in found), tuple(v for _, v in found), rest

    def _explain(self, windows: int) -> str:
        """Why the wait for the losses reduced after `windows` windows timed out."""
        assert self.timeout_s is not None
        return timeout_message(
            f"rank {dist.get_rank()}",
            f"the loss exchange of window {windows - 1}",
            self.timeout_s,
            "the all-reduce of the losses over every rank",
            peers=dist.get_world_size() - 1,
        )


def _to(value: Any, device: torch.device) -> Any:
    return pytree.tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, value)


def _sync_replicas(stages: dict[int, nn.Module], meshes: Meshes) -> None:
    """Make every dp replica start from dp rank 0's weights (and buffers); expert weights
    from their replica group's first rank (the ranks of an ep group hold different ones)."""
    mesh = meshes.main
    if mesh.size(mesh.mesh_dim_names.index("dp")) == 1:  # type: ignore[union-attr]
        return
    group, experts = mesh.get_group("dp"), meshes.expert_dp_group()
    for stage in stages.values():
        own = {id(p) for p in expert_params(stage)} if meshes.expert is not None else set()
        for t in [*stage.parameters(), *stage.buffers()]:
            local = t.to_local() if hasattr(t, "to_local") else t
            g = experts if id(t) in own else group
            dist.broadcast(local.data, src=dist.get_global_rank(g, 0), group=g)


def parallelize(
    model: nn.Module,
    plan: ParallelPlan,
    optimizer_factory: OptimizerFactory,
    loss_fn: LossFn,
    *,
    mesh: DeviceMesh | None = None,
    device: torch.device | str | None = None,
    grad_clip: float | None = None,
    timeout_s: float | None = DEFAULT_TIMEOUT_S,
    scheduler_factory: SchedulerFactory | None = None,
    compile: bool = False,
) -> Engine:
    """An `Engine` that trains `model` under `plan` on the current process group.

    Every rank passes the same model, initialised identically (same seed); the engine
    keeps only this rank's stages, sharded as the plan says. `optimizer_factory(params)`
    builds an optimizer over one stage's local parameters (with ZeRO-1 it is wrapped in
    torch's ZeroRedundancyOptimizer so each dp rank keeps 1/dp of the optimizer state).
    A wait for a peer's message or reduction longer than `timeout_s` seconds raises
    `plait.runtime.transport.PipelineTimeout` naming the action and the peer (None: wait
    as long as the process group's timeout; see that module). `scheduler_factory(optimizer,
    updates_per_window)` builds each stage's learning-rate schedule, stepped once per
    update of that stage (an asynchronous schedule makes several updates per window).
    `compile` torch.compiles each block after recomputation (`plait.train.compile`).
    """
    check_parallelize_arguments(model, plan, optimizer_factory, loss_fn)
    if plan.pipelines is not None or plan.wsp_staleness is not None:  # pipelines of their own
        from plait.train.hetero import parallelize_hetero

        return parallelize_hetero(model, plan, optimizer_factory, loss_fn, device=device,
                                  grad_clip=grad_clip, timeout_s=timeout_s,
                                  scheduler_factory=scheduler_factory,
                                  compile=compile)  # fmt: skip
    device = torch.device(device) if device is not None else current_device()
    if compile:
        check_compile(ep=plan.ep)
    if mesh is not None and plan.ep > 1:
        raise ValueError(
            f"ep={plan.ep} with a mesh given: the expert view of the ranks is built with it; "
            "pass mesh=None"
        )
    meshes = (
        Meshes(main=mesh)
        if mesh is not None
        else ParallelDims(
            dp=plan.dp, tp=plan.tp, pp=plan.pp, ep=plan.ep, rank_order=plan.rank_order
        ).build_mesh(device.type, experts=bool(expert_params(model)))
    )
    mesh = meshes.main
    names = block_names(model)
    schedule = build(plan.schedule, plan.pp, plan.microbatches, plan.chunks)
    channels = _channels(schedule, mesh)
    pp_rank = mesh.get_local_rank("pp")
    stages: dict[int, nn.Module] = dict(
        local_stages(model, schedule, pp_rank, sizes=plan.partition, device=device)
    )
    ep_group = meshes.ep_group()
    tp_group = mesh.get_group("tp") if plan.tp > 1 else None
    for stage in stages.values():
        if ep_group is not None or tp_group is not None:  # same seed everywhere: keep ours
            shard_experts(stage, ep_group, tp_group=tp_group)
        if plan.tp > 1:
            apply_tensor_parallel(stage, mesh["tp"], sequence_parallel=plan.sequence_parallel)
        apply_recompute(stage, plan.recompute)
        if compile:  # after recomputation, before ZeRO-2/3 (torchtitan's order)
            apply_compile(stage)
    _sync_replicas(stages, meshes)
    grad_sync: GradSync | None = None
    if plan.zero >= 2:
        reduce = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(plan.compress)
        edp = meshes.expert["edp"] if meshes.expert is not None else None
        sharded = {
            s: apply_fsdp(m, mesh["dp"], zero=plan.zero, reduce_dtype=reduce, expert_mesh=edp)
            for s, m in stages.items()
        }
        scaled = {s: expert_params(m) for s, m in stages.items()} if edp is not None else None
        grad_sync = FSDPGradSync(sharded, scaled=scaled, scale=expert_grad_scale(plan.ep, plan.tp))
    elif plan.dp > 1 or meshes.expert is not None:
        per_stage = {s: list(m.parameters()) for s, m in stages.items()}
        group = mesh.get_group("dp")
        hook, state = hook_for(plan.compress, group) or (None, None)
        # expert gradients: averaged over the ranks holding the same experts, then × tp/ep
        # (their replica sum / dp; see plait.parallel.experts)
        experts = {p: meshes.expert_dp_group() for m in stages.values() for p in expert_params(m)}
        grad_sync = GradReducer(
            per_stage,
            group,
            param_groups=experts if meshes.expert is not None else None,
            group_scale=expert_grad_scale(plan.ep, plan.tp),
            timeout_s=timeout_s,
            hook=hook,
            hook_state=state,
        )
    grad_sync = with_replicas(grad_sync, schedule, stages, mesh)  # Chimera's replica sums
    optimizers = {
        s: _optimizer(
            optimizer_factory,
            [p for p in m.parameters() if p.requires_grad],
            plan,
            mesh,
            meshes,
            expert_params(m),
        )
        for s, m in stages.items()
    }
    apply_offload(stages, optimizers, activations=plan.offload_activations,
                  optimizer=plan.offload_optimizer, num_blocks=len(names))  # fmt: skip
    grad_clip = _with_dgc(grad_sync, optimizers, grad_clip)
    schedulers = (
        {
            s: scheduler_factory(o, max(1, schedule.updates_per_window))
            for s, o in optimizers.items()
        }
        if scheduler_factory is not None
        else None
    )
    return Engine(
        schedulers=schedulers,
        plan=plan,
        mesh=mesh,
        schedule=schedule,
        stages=stages,
        optimizers=optimizers,
        grad_sync=grad_sync,
        loss_fn=loss_fn,
        device=device,
        grad_clip=grad_clip,
        block_names=names,
        timeout_s=timeout_s,
        meshes=meshes,
        channels=channels,
    )


def _channels(schedule: Schedule, mesh: DeviceMesh) -> Channels | None:
    """Every pipeline's message channels (`plait.runtime.channels`), made on every rank
    in one order; this rank's. Each pipeline is the pp column of one (dp, tp) place."""
    if schedule.num_ranks == 1:
        return None
    names = mesh.mesh_dim_names or ()
    grid = mesh.mesh.movedim(names.index("pp"), 0).reshape(mesh["pp"].size(), -1)
    pipelines = [(schedule, [int(r) for r in grid[:, j]]) for j in range(grid.shape[1])]
    return build_channels(pipelines)


def _with_dgc(
    grad_sync: GradSync | None, optimizers: dict[int, Any], grad_clip: float | None
) -> float | None:
    """Under DGC the hook takes SGD's momentum (momentum correction) and, with its local
    clipping, the clip threshold: nothing is clipped after the reduction then."""
    from plait.parallel.dgc import DGCState, take_momentum

    state = getattr(grad_sync, "hook_state", None)
    if not isinstance(state, DGCState):
        return grad_clip
    take_momentum(state, optimizers.values(), grad_clip)
    return None if state.options.clipping else grad_clip


def _optimizer(
    factory: OptimizerFactory,
    params: list[nn.Parameter],
    plan: ParallelPlan,
    mesh: DeviceMesh,
    meshes: Meshes | None = None,
    experts: list[nn.Parameter] | None = None,
) -> torch.optim.Optimizer:
    if plan.zero != 1 or plan.dp == 1:
        return factory(params)
    if plan.tp > 1:
        raise ValueError(
            "zero=1 with tp > 1 is not supported (torch's ZeroRedundancyOptimizer takes plain "
            "tensors): use zero=2 or zero=3, which shard optimizer state too, or tp=1"
        )
    from plait.parallel.expert_zero import ExpertZero, partitioned

    if meshes is None or meshes.expert is None or not experts:
        return partitioned(factory(params), mesh.get_group("dp"))
    # experts partitioned over the ranks holding the same ones, the rest over dp
    ids = {id(p) for p in experts}
    rest, mine = [p for p in params if id(p) not in ids], [p for p in params if id(p) in ids]
    return ExpertZero([partitioned(factory(rest), mesh.get_group("dp")),
                       partitioned(factory(mine), meshes.expert_dp_group())])  # fmt: skip


def _batch_size(value: Any) -> int:
    """Samples in a batch: dim 0 of its first tensor."""
    leaves = [t for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]
    if not leaves:
        raise ValueError("a batch must hold at least one tensor (its dim 0 counts samples)")
    return int(leaves[0].shape[0])


def _eval_parts(size: int, dp: int, index: int, m: int) -> list[tuple[int, int, int, bool]]:
    """(first sample, micro-batches, samples each, counted) of each forward-only program
    that replica `index` of `dp` runs to evaluate `size` samples with `m` micro-batches.
    Every replica runs as many forwards (ZeRO-3 gathers weights in each): replica 0 takes
    the `size % dp` samples left over into its last micro-batch; with fewer samples than
    replicas, each replica computes them all and only replica 0 counts them."""
    share, tail = divmod(size, dp)
    if share == 0:
        return [(0, 1, size, index == 0)] if size else []
    each = -(-share // m)
    count = -(-share // each)
    first = index * share + (tail if index else 0)
    if not tail and share % each == 0:
        return [(first, count, each, True)]
    # two programs on every replica, whatever its own last size: each describes its
    # boundaries anew, and ZeRO-3's probes gather weights there
    last = share - (count - 1) * each + (0 if index else tail)
    full = [(first, count - 1, each, True)] if count > 1 else []
    return [*full, (first + (count - 1) * each, 1, last, True)]


def _rows(value: Any, start: int, count: int) -> Any:
    """Samples start..start+count of every tensor of `value` (dim 0)."""
    return pytree.tree_map(
        lambda t: t[start : start + count] if isinstance(t, torch.Tensor) else t, value
    )
