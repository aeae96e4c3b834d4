"""The executor: runs one rank's stream of a `Schedule` on torch.distributed, window by window.

Each window's actions (`plait.schedule.stream.RankStream`) are lowered once
(`plait.schedule.lower.lower`: peers, channels, local hand-offs, where each compute's
input comes from and its output goes) and the lowered program is run by the one backend
(`plait.runtime.backend.Backend`); evaluation is a forward-only program
(`plait.schedule.passes.forward_only`) run by the same backend. `step` runs the next
window (its micro-batches given by the caller), `drain` what remains of micro-batches
already begun; state (saved activations, posted receives, weight copies) persists across
windows, so a window may finish micro-batches an earlier one began. Sends are
asynchronous; a window waits for the sends of windows old enough that their peer has
received them. Receives are posted where the program places them and waited only by the
compute that consumes them. Boundary shapes are described once per input shape, so the
receive buffers are sized before they are posted. Each micro-batch has its own autograd
graph; its loss is scaled by its share of the update it belongs to, so the accumulated
gradients equal those of one pass over the update's micro-batches. Every action is timed
by the device's clock and labelled for the profiler (`PP:2F0`).

torch.distributed.pipelining has an executor too; plait keeps its own because it runs
plait's IR (which the simulator replays as well), carries tuples and dicts across
boundaries whose entries may skip stages, executes BI/BW as two real passes for any
schedule the validator accepts, and runs asynchronous schedules whose windows overlap.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from plait.device import ActionClock
from plait.runtime.backend import Backend, MetricFn, State, Updater, Window
from plait.runtime.boundary import BoundaryMeta, NegotiationTimeout, negotiate
from plait.runtime.channels import Channels, build_channels, release
from plait.runtime.sync import GradSync
from plait.runtime.transport import Transport
from plait.runtime.weights import Predictor, WeightStore
from plait.schedule import RankStream, Schedule
from plait.schedule.lower import lower
from plait.schedule.passes import forward_only
from plait.wait import DEFAULT_TIMEOUT_S, PipelineTimeout

__all__ = ["ActionRecord", "EvalSums", "PipelineExecutor", "StepResult", "Updater"]

LossFn = Callable[[Any, Any], torch.Tensor]


@dataclass(frozen=True, slots=True)
class ActionRecord:
    """When one action ran on this rank (seconds from the start of the window)."""

    rank: int
    index: int
    label: str
    start: float  # the handler began (for a compute action: once its inputs were there)
    end: float
    wait: float = 0.0  # seconds spent waiting for received data before `start`


@dataclass
class StepResult:
    """One window's outcome on this rank. `records` are read from the device's clock on
    first use (on a GPU after the step's synchronisation, so reading them costs none)."""

    loss: torch.Tensor | None  # mean loss of the micro-batches it finished (a last stage)
    losses: list[torch.Tensor] = field(default_factory=list)  # theirs, in order of finishing
    microbatches: list[int] = field(default_factory=list)  # their global ids
    updates: int = 0  # optimizer steps per stage (UPDATE actions of its first stage)
    _records: Callable[[], list[ActionRecord]] | list[ActionRecord] = field(
        default_factory=list, repr=False
    )

    @property
    def records(self) -> list[ActionRecord]:
        if callable(self._records):
            self._records = self._records()
        return self._records

    @records.setter
    def records(self, value: list[ActionRecord]) -> None:
        self._records = value

    @property
    def step_time(self) -> float:
        """Seconds from the window's start to its last action's end."""
        return max((r.end for r in self.records), default=0.0)


@dataclass(frozen=True)
class EvalSums:
    """This rank's sums over the micro-batches its last stages finished (zeros elsewhere):
    [loss × samples, samples, metric sums in the order of the names]."""

    values: torch.Tensor
    names: tuple[str, ...]


class PipelineExecutor:
    """Executes this rank's stream of `schedule` for its `stages` (global stage -> module).

    `group` is the pipeline process group; schedule rank r is group rank r. Messages
    travel on `channels` (`plait.runtime.channels`: a group per directed pair of pipeline
    ranks); without them the executor makes them, which is collective over the world and
    so needs `group` to hold every rank (builders of several pipelines make theirs for all
    at once). The loss function takes (output of a last stage, targets of the micro-batch)
    and returns the micro-batch's mean loss. `updater(stage, version)` runs the optimizer
    step of an UPDATE; without one (synchronous schedules only) the caller steps after the
    window. `predictor` fills predicted weights for schedules that predict them. On CPU
    workers a wait for a peer longer than `timeout_s` seconds raises `PipelineTimeout`
    (None: the group's timeout); a GPU's waits are stream-ordered and bounded by the
    group's timeout.
    """

    def __init__(
        self,
        schedule: Schedule,
        stages: Mapping[int, nn.Module],
        *,
        rank: int,
        loss_fn: LossFn,
        group: dist.ProcessGroup | None = None,
        channels: Channels | None = None,
        device: torch.device | str = "cpu",
        grad_sync: GradSync | None = None,
        forward_context: Callable[[], AbstractContextManager[Any]] | None = None,
        updater: Updater | None = None,
        predictor: Predictor | None = None,
        timeout_s: float | None = DEFAULT_TIMEOUT_S,
    ) -> None:
        mine = set(schedule.stages_of(rank))
        if set(stages) != mine:
            raise ValueError(
                f"rank {rank} runs stages {sorted(mine)} of the schedule but was given modules "
                f"for stages {sorted(stages)}"
            )
        if updater is None and schedule.policy != "sync":
            raise ValueError(
                f"schedule {schedule.kind!r} updates weights inside its program "
                f"(policy {schedule.policy!r}): pass updater= (plait.parallelize does)"
            )
        self.schedule, self.stages, self.rank = schedule, stages, rank
        self.loss_fn, self.group = loss_fn, group
        self.device = torch.device(device)
        self.channels = channels if channels is not None else _own_channels(schedule, group)
        self.closed = self._running = False
        self.timeout_s = timeout_s
        self.weights = WeightStore(stages, predictor=predictor)
        self.backend = Backend(
            schedule, stages, loss_fn=loss_fn, device=self.device, grad_sync=grad_sync,
            forward_context=forward_context or contextlib.nullcontext, updater=updater,
            weights=self.weights, clock=ActionClock(self.device),
        )  # fmt: skip
        self.stream = RankStream(schedule, rank)
        self.transport = self._transport(schedule)
        self.needs_inputs = any(schedule.is_first(s) for s in mine)
        self.needs_targets = any(schedule.is_last(s) for s in mine)
        self._meta_key: object = None
        self._negotiated = False
        self._agreed: object = None
        self._state = State()
        self.windows = 0

    def _transport(self, schedule: Schedule) -> Transport:
        return Transport(schedule, self.rank, self.channels, timeout_s=self.timeout_s,
                         stream_ordered=self.device.type == "cuda")  # fmt: skip

    @property
    def forward_context(self) -> Callable[[], AbstractContextManager[Any]]:
        return self.backend.forward_context

    @property
    def grad_sync(self) -> GradSync | None:
        return self.backend.grad_sync

    @property
    def _meta(self) -> dict[int, BoundaryMeta]:
        return self.backend.meta

    # ------------------------------------------------------------------ public
    def step(
        self,
        inputs: Sequence[Any] | None = None,
        targets: Sequence[Any] | None = None,
        *,
        loss_scale: float = 1.0,
    ) -> StepResult:
        """Run the next window. `inputs` (its micro-batches for the first stages) are needed
        only on ranks that hold a first stage, `targets` only on ranks that hold a last
        stage; elsewhere pass None. Backward runs on the loss times `loss_scale` (fp16 loss
        scaling); the reported losses are unscaled."""
        m = self.schedule.num_microbatches
        self._check(inputs, targets, m)
        self._negotiate(inputs)
        base = self.windows * m
        self._keep(self._state, self.schedule, base, inputs, targets)
        actions = self.stream.window()
        result = self._run(actions, loss_scale)
        self.windows += 1
        self.transport.settle(self.windows - 1 - self.schedule.reach)
        return result

    def evaluate(
        self,
        inputs: Sequence[Any] | None,
        targets: Sequence[Any] | None,
        metrics: Mapping[str, MetricFn],
        *,
        count: int | None = None,
        agreed: object = None,
    ) -> EvalSums:
        """A forward-only pass over `count` micro-batches of one shape (default: a window's)
        on the current weights, without gradients, in eval mode (dropout off, batch-norm
        statistics untouched), under the forward context (autocast); the training stream
        must have nothing in flight. `agreed` names the micro-batches' shape on every rank
        of the pipeline (e.g. their size): when it changes, all of them describe their
        boundaries again, as ranks without inputs cannot see the shape change themselves.

        The program (`forward_only`) lists, micro-batch by micro-batch along its path of
        stages, each local stage's receive, forward and send: every rank meets its peers in
        the same order, so it cannot deadlock. It runs on a fresh `Transport` after the
        training stream has settled, so no training message can match its receives."""
        m = self.schedule.num_microbatches if count is None else count
        self._check_open()
        self._check(inputs, targets, m)
        if self.windows and not self.stream.drained and self.schedule.reach:
            raise RuntimeError("an asynchronous stream is in flight: drain() before evaluate")
        self._negotiate(inputs, agreed)
        program = forward_only(self.schedule, m)
        state = State()
        self._keep(state, program, 0, inputs, targets)
        names = tuple(metrics)
        sums = torch.zeros(2 + len(names), device=self.device, dtype=torch.float64)
        window = Window(sums=sums, metrics=metrics)
        transport = self._transport(program)
        modes = {s: module.training for s, module in self.stages.items()}
        try:
            for module in self.stages.values():
                module.eval()
            lowered = lower(program, self.rank, program.ranks[self.rank])
            self._running = True  # on the training channels: a failed pass keeps them
            self.backend.run(lowered, state, transport, window)
            self._running = False
            transport.settle(0)
        finally:
            for s, module in self.stages.items():
                module.train(modes[s])
        return EvalSums(sums, names)

    def restart(self) -> None:
        """Begin a new stream after `drain`: window 0 again, weight versions from 0."""
        if not self.stream.drained:
            raise RuntimeError("restart() follows drain(): drain the stream first")
        self.stream = RankStream(self.schedule, self.rank)
        self.weights = WeightStore(self.stages, predictor=self.weights.predictor)
        self.backend.weights = self.weights
        self.windows = 0

    def close(self) -> None:
        """Release this rank's pipeline channels (`plait.runtime.channels.release`): every
        rank, after its last window. A rank whose window failed keeps them (a receive it
        abandoned may still be posted on one). No window runs after it."""
        channels, self.channels, self.closed = self.channels, None, True
        if channels is not None and not self._running:
            release(channels)

    def drain(self, *, loss_scale: float = 1.0) -> StepResult:
        """Finish the micro-batches begun by earlier windows (an asynchronous pipeline's
        drain; nothing for a synchronous one). The stream ends here."""
        result = self._run(self.stream.drain(), loss_scale)
        self.transport.settle(self.windows)
        return result

    # ------------------------------------------------------------- internals
    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError("this pipeline was closed (close()): build a new engine")

    def _check(self, inputs: Sequence[Any] | None, targets: Sequence[Any] | None, m: int) -> None:
        if self.needs_inputs and (inputs is None or len(inputs) != m):
            raise ValueError(
                f"rank {self.rank} holds a first stage and needs {m} input micro-batches"
            )
        if self.needs_targets and (targets is None or len(targets) != m):
            raise ValueError(f"rank {self.rank} holds a last stage and needs {m} targets")

    def _keep(
        self,
        state: State,
        schedule: Schedule,
        base: int,
        inputs: Sequence[Any] | None,
        targets: Sequence[Any] | None,
    ) -> None:
        """Keep only what a stage of ours consumes: first stages' inputs, last stages'
        targets (micro-batches `base`, `base + 1`, ...)."""
        for j in range(len(inputs if inputs is not None else targets or ())):
            path = schedule.path(base + j)
            if inputs is not None and path[0] in self.stages:
                state.inputs[base + j] = inputs[j]
            if targets is not None and path[-1] in self.stages:
                state.targets[base + j] = targets[j]

    def _run(self, actions: Sequence[Any], loss_scale: float) -> StepResult:
        self._check_open()
        program = lower(self.schedule, self.rank, actions)
        clock = self.backend.clock
        start = clock.start()
        window = Window(loss_scale=loss_scale, window=self.windows)
        self._running = True  # until it ends: a failed window may leave receives posted
        self.backend.run(program, self._state, self.transport, window)
        self._running = False
        result = StepResult(None, window.losses, window.microbatches, window.updates)
        if window.losses:
            result.loss = torch.stack(window.losses).mean()
        rank = self.rank

        def records() -> list[ActionRecord]:
            marks = [m for _, _, *three in window.marks for m in three]
            times = iter(clock.seconds(marks, start))
            out = []
            for (index, action, *_), wait in zip(window.marks, window.waits, strict=True):
                begun, ready, end = next(times), next(times), next(times)
                out.append(ActionRecord(rank, index, str(action), max(begun + wait, ready), end,
                                        max(wait, ready - begun)))  # fmt: skip
            return out

        result.records = records  # type: ignore[assignment]
        return result

    def _negotiate(self, inputs: Sequence[Any] | None, agreed: object = None) -> None:
        """Learn every boundary's structure and shapes once per input shape (and again
        whenever `agreed`, a shape every rank of the pipeline was told, changes)."""
        key = BoundaryMeta.of(inputs[0]) if inputs is not None else None
        same = key is None or key == self._meta_key
        if self._negotiated and same and agreed == self._agreed:
            return
        self._negotiated, self._meta_key, self._agreed = True, key, agreed
        sample = inputs[0] if inputs is not None else None
        try:
            self.backend.meta = negotiate(self.schedule, self.stages, self.rank, sample,
                                          group=self.group, device=self.device,
                                          forward_context=self.forward_context)  # fmt: skip
        except NegotiationTimeout as err:  # bounded by the process group's timeout
            raise PipelineTimeout(f"pipeline rank {self.rank}: {err}; the peer may have "
                                  "failed or stalled: check its log") from err  # fmt: skip


def _own_channels(schedule: Schedule, group: dist.ProcessGroup | None) -> Channels | None:
    """The channels of a pipeline that holds every rank of the world (see the class)."""
    if schedule.num_ranks == 1:
        return None
    whole = group if group is not None else dist.group.WORLD
    ranks = dist.get_process_group_ranks(whole) if whole is not None else []
    if len(ranks) != dist.get_world_size():
        raise ValueError(
            "a pipeline that holds only some of the world's ranks needs its channels: make "
            "them for every pipeline at once with plait.runtime.channels.build_channels and "
            "pass channels= (plait.parallelize does)"
        )
    return build_channels([(schedule, ranks)])
