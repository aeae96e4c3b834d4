"""`Engine`: this rank's share of a model, trained under a plan window by window.

`plait.train.parallelize` builds it (its passes shard, wrap and compile the stages and
build the gradient sync and optimizers); the engine wires the layers below. Each window (one
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
(`plait.train.losses.LossExchange`): one host read per step for fp32 and bf16 on any device, and for
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

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from plait.blocks import block_params
from plait.config import ParallelPlan
from plait.device import autocast_context
from plait.keyed import StepDraws, has_keyed_dropout
from plait.mesh import Meshes
from plait.parallel import clip_grad_norm, expert_params
from plait.parallel.replicas import uncounted_params
from plait.runtime import PipelineExecutor, StepResult, split_microbatches
from plait.runtime.backend import MetricFn
from plait.runtime.channels import Channels
from plait.runtime.predict import optimizer_predictor
from plait.runtime.sync import GradSync
from plait.schedule import Schedule
from plait.train.batches import batch_size as _batch_size
from plait.train.batches import eval_parts as _eval_parts
from plait.train.batches import rows as _rows
from plait.train.batches import sequence_shard
from plait.train.batches import to_device as _to
from plait.train.losses import LossExchange
from plait.train.precision import LossScaler, skips_on_device, step_unless_found
from plait.wait import DEFAULT_TIMEOUT_S, named_timeout, timeout_message

__all__ = ["Engine", "EvalReport", "StepReport"]

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
# (a stage's optimizer, optimizer updates per window) -> its learning-rate schedule
SchedulerFactory = Callable[[torch.optim.Optimizer, int], torch.optim.lr_scheduler.LRScheduler]
LossFn = Callable[[Any, Any], torch.Tensor]


@dataclass(frozen=True)
class StepReport:
    """One window (one training step), as every rank sees it."""

    # the mean loss of the micro-batches it reports (NaN if none): those the window finished;
    # for an asynchronous schedule those finished `reach + 1` windows earlier (their exchange
    # overlaps the later windows instead of stalling the pipeline); the drain reports the rest
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
        seed: int = 0,
        first_microbatch: int | None = None,  # of the global batch's (None: dp_index × m)
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
        self._clip_blocks = block_params(stages)  # clipping independent of the split
        self.scaler = LossScaler() if plan.dtype == "fp16" else None
        # which of dp equal slices of a global batch this rank trains on (and evaluates)
        self.dp_index = plan.layout.batch_shard(dist.get_rank())[0] if plan.dp > 1 else 0
        # which zigzag pair of sequence chunks (dim 1) this rank takes, under cp > 1
        self.cp_index = plan.layout.index("cp", dist.get_rank()) if plan.cp > 1 else 0
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
        self._losses = LossExchange(plan, schedule, device, timeout_s)
        # dropout keyed by (seed, step, sample, site), the same under any layout
        first = self.dp_index * plan.microbatches if first_microbatch is None else first_microbatch
        self.draws = StepDraws(seed, plan.microbatches, first)
        self.executor.backend.draw = self.draws if has_keyed_dropout([*stages.values()]) else None

    # ------------------------------------------------------------------ steps
    def step(self, batch: tuple[Any, Any], *, index: int | None = None) -> StepReport:
        """One window on the global `batch` = (inputs, targets); every rank may pass the
        same batch; each dp rank trains on its own slice of dim 0, in m micro-batches.
        `index`: the run's step number (keys dropout; default: this engine's windows)."""
        if index is not None:
            self.draws.offset = index - self.executor.windows

        def micro(value: Any, needed: bool) -> list[Any] | None:  # this rank's, if it needs them
            m = self.plan.microbatches
            return split_microbatches(_to(self._shard(value), self.device), m) if needed else None

        (inputs, targets), run = batch, self.executor
        return self._window(micro(inputs, run.needs_inputs), micro(targets, run.needs_targets))

    def drain(self) -> StepReport:
        """Finish every micro-batch begun (an asynchronous pipeline's drain; a synchronous
        one has nothing left). Call once, after the last step."""
        result = self.executor.drain()
        return self._report(result, last=True)

    def close(self) -> None:
        """Release its pipeline channels (`PipelineExecutor.close`), after the last step."""
        self.executor.close()

    @property
    def in_flight(self) -> bool:
        """An asynchronous stream has begun micro-batches that no drain has finished."""
        stream = self.executor.stream
        return not self.synchronous and bool(self.executor.windows) and not stream.drained

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
        if self.in_flight:
            drained = self.drain()
        inputs, targets = batch
        values: torch.Tensor | None = None
        size, dp, m = _batch_size(targets), self.plan.dp, self.plan.microbatches
        parts = _eval_parts(size, dp, self.dp_index, m)
        for k, (first, count, each, counted) in enumerate(parts):
            starts = [first + i * each for i in range(count)]
            micro_in = micro_tg = None
            if self.executor.needs_inputs:
                micro_in = [_to(self._seq(_rows(inputs, at, each)), self.device) for at in starts]
            if self.executor.needs_targets:
                micro_tg = [_to(self._seq(_rows(targets, at, each)), self.device) for at in starts]
            # every replica runs these programs in this order (ZeRO-3 gathers weights in each
            # forward and each boundary probe), keyed alike: shapes are described anew on all
            # replicas at once, or on none
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
        # tp replicas of a last stage count once; cp ranks' equal sequence shards average
        values = values / (self.plan.tp * self.plan.cp)
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
        """This rank's slice of a global batch (dim 0), cut over the layout's batch axes;
        under context parallelism, its two zigzag chunks of the sequence (dim 1)."""
        if self.plan.dp > 1:
            value = split_microbatches(value, self.plan.dp)[self.dp_index]
        return self._seq(value)

    def _seq(self, value: Any) -> Any:
        return sequence_shard(value, self.plan.cp, self.cp_index)

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
        with named_timeout(self._explain_check):
            if self.scaler is not None:
                self._found_inf = self.scaler.unscale_(self.params, self.device)
            if self.grad_clip is not None:
                self._norm = clip_grad_norm(self.params, self.grad_clip,
                                            pp_group=self._pp_group, ep_group=self.ep_group,
                                            ep_params=self.ep_params,
                                            uncounted=self.uncounted,
                                            blocks=self._clip_blocks,
                                            num_blocks=len(self.block_names))  # fmt: skip

    def _explain_check(self) -> str:
        return timeout_message(
            f"rank {dist.get_rank()}", "the step's overflow check and clipped gradient norm",
            self.timeout_s, "the other ranks' norms", peers=dist.get_world_size() - 1,
        )  # fmt: skip

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
