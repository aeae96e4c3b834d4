"""The executor: runs one rank's stream of a `Schedule` on torch.distributed, window by window.

One loop, no schedule-specific branch: each action kind has one handler. `step` runs the
next window (its micro-batches given by the caller), `drain` what remains of micro-batches
already begun; state (saved activations, posted receives, weight copies) persists across
windows, so a window may finish micro-batches an earlier one began. Sends are
asynchronous (`isend`); a window waits for the sends of windows old enough that their
peer has received them. Receives are posted where the program places them and waited only
by the compute that consumes them. Boundary shapes are negotiated once per input shape.
Each micro-batch has its own autograd graph; its loss is scaled by its share of the update
it belongs to, so the accumulated gradients equal those of one pass over the update's
micro-batches. `REDUCE` and `UPDATE` call the data-parallel reducer and the caller's
updater; `STASH`, `PREDICT` and `FREE` manage weight copies (`plait.runtime.weights`).
Every action is stamped with wall-clock times and labelled for the profiler (`PP:2F0`).

torch.distributed.pipelining has an executor too; plait keeps its own because it runs
plait's IR (which the simulator replays as well), carries tuples and dicts across
boundaries whose entries may skip stages, executes BI/BW as two real passes for any
schedule the validator accepts, and runs asynchronous schedules whose windows overlap.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd.profiler import record_function

from plait.compat import profiler_enabled
from plait.parallel.sync import GradSync
from plait.runtime.backward import (
    Saved,
    backward_full,
    backward_input,
    backward_weight,
    split_is_exact,
)
from plait.runtime.boundary import (
    BoundaryMeta,
    NegotiationTimeout,
    flatten,
    negotiate,
    unflatten,
)
from plait.runtime.evaluate import EvalSums, MetricFn, evaluate
from plait.runtime.transport import DEFAULT_TIMEOUT_S, PipelineTimeout, Transport
from plait.runtime.weights import Predictor, WeightStore
from plait.schedule import Action, Op, RankStream, Schedule, completing_backwards

__all__ = ["ActionRecord", "PipelineExecutor", "StepResult", "Updater"]

LossFn = Callable[[Any, Any], torch.Tensor]
Updater = Callable[[int, int], None]  # (stage, version it produces): the optimizer step


@dataclass(frozen=True, slots=True)
class ActionRecord:
    """When one action ran on this rank (seconds from the start of the window)."""

    rank: int
    index: int
    label: str
    start: float  # the handler began (for a compute action: after waiting for its inputs)
    end: float
    wait: float = 0.0  # seconds spent waiting for received data before `start`


@dataclass
class StepResult:
    """One window's outcome on this rank."""

    loss: torch.Tensor | None  # mean loss of the micro-batches it finished (a last stage)
    losses: list[torch.Tensor] = field(default_factory=list)  # theirs, in order of finishing
    microbatches: list[int] = field(default_factory=list)  # their global ids
    updates: int = 0  # optimizer steps per stage (UPDATE actions of its first stage)
    records: list[ActionRecord] = field(default_factory=list)
    step_time: float = 0.0


@dataclass
class _Stream:
    """What outlives a window: data waiting for its consumer, activations waiting for their
    backward (messages in flight live in the `Transport`)."""

    inputs: dict[int, Any] = field(default_factory=dict)
    targets: dict[int, Any] = field(default_factory=dict)
    saved: dict[tuple[int, int], Saved] = field(default_factory=dict)
    local: dict[tuple[Op, int, int], Any] = field(default_factory=dict)
    outgoing: dict[tuple[Op, int, int], list[torch.Tensor]] = field(default_factory=dict)


@dataclass
class _Window:
    t0: float
    loss_scale: float
    result: StepResult
    last_backward: set[int]  # program indices whose backward completes a stage's update


class PipelineExecutor:
    """Executes this rank's stream of `schedule` for its `stages` (global stage -> module).

    `group` is the pipeline process group; schedule rank r is group rank r. The loss
    function takes (output of a last stage, targets of the micro-batch) and returns the
    micro-batch's mean loss. `updater(stage, version)` runs the optimizer step of an
    UPDATE; without one (synchronous schedules only) the caller steps after the window.
    `predictor` fills predicted weights for schedules that predict them. A wait for a peer
    longer than `timeout_s` seconds raises `PipelineTimeout` (None: the group's timeout).
    """

    def __init__(
        self,
        schedule: Schedule,
        stages: Mapping[int, nn.Module],
        *,
        rank: int,
        loss_fn: LossFn,
        group: dist.ProcessGroup | None = None,
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
        self.schedule = schedule
        self.stages = stages
        self.rank = rank
        self.loss_fn = loss_fn
        self.group = group
        self.device = torch.device(device)
        self.grad_sync = grad_sync
        self.updater = updater
        self.forward_context = forward_context or contextlib.nullcontext
        self.weights = WeightStore(stages, predictor=predictor)
        self.stream = RankStream(schedule, rank)
        self.transport = Transport(schedule, rank, group, timeout_s=timeout_s)
        self.needs_inputs = any(schedule.is_first(s) for s in mine)
        self.needs_targets = any(schedule.is_last(s) for s in mine)
        u, m = schedule.updates_per_window, schedule.num_microbatches
        self.share = u / m if u else 1.0 / m  # of an update's micro-batches, one's weight
        self._meta: dict[int, BoundaryMeta] = {}  # stage -> meta of its input boundary
        self._meta_key: object = None
        self._negotiated = False
        self._agreed: object = None
        self._exact_split: dict[int, bool] = {}
        self._state = _Stream()
        self._first_stage = min(mine)
        self.windows = 0

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
        if self.needs_inputs and (inputs is None or len(inputs) != m):
            raise ValueError(
                f"rank {self.rank} holds a first stage and needs {m} input micro-batches"
            )
        if self.needs_targets and (targets is None or len(targets) != m):
            raise ValueError(f"rank {self.rank} holds a last stage and needs {m} targets")
        self._negotiate(inputs)
        base = self.windows * m
        for j in range(m):
            path = self.schedule.path(base + j)  # keep only what a stage of ours consumes
            if inputs is not None and path[0] in self.stages:
                self._state.inputs[base + j] = inputs[j]
            if targets is not None and path[-1] in self.stages:
                self._state.targets[base + j] = targets[j]
        result = self._run(self.stream.window(), loss_scale)
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
        on the current weights (see `plait.runtime.evaluate`); the training stream must have
        nothing in flight. `agreed` names the micro-batches' shape on every rank of the
        pipeline (e.g. their size): when it changes, all of them describe their boundaries
        again, as ranks without inputs cannot see the shape change themselves."""
        m = self.schedule.num_microbatches if count is None else count
        if self.needs_inputs and (inputs is None or len(inputs) != m):
            raise ValueError(f"rank {self.rank} holds a first stage and needs {m} inputs")
        if self.needs_targets and (targets is None or len(targets) != m):
            raise ValueError(f"rank {self.rank} holds a last stage and needs {m} targets")
        if self.windows and not self.stream.drained and self.schedule.reach:
            raise RuntimeError("an asynchronous stream is in flight: drain() before evaluate")
        self._negotiate(inputs, agreed)
        return evaluate(self, inputs, targets, metrics, m)

    def restart(self) -> None:
        """Begin a new stream after `drain`: window 0 again, weight versions from 0."""
        if not self.stream.drained:
            raise RuntimeError("restart() follows drain(): drain the stream first")
        self.stream = RankStream(self.schedule, self.rank)
        self.weights = WeightStore(self.stages, predictor=self.weights.predictor)
        self.windows = 0

    def drain(self, *, loss_scale: float = 1.0) -> StepResult:
        """Finish the micro-batches begun by earlier windows (an asynchronous pipeline's
        drain; nothing for a synchronous one). The stream ends here."""
        result = self._run(self.stream.drain(), loss_scale)
        self.transport.settle(self.windows)
        return result

    # ------------------------------------------------------------- the window
    def _run(self, program: Sequence[Action], loss_scale: float) -> StepResult:
        window = _Window(
            time.perf_counter(), loss_scale, StepResult(None), completing_backwards(program)
        )
        # labels cost ~15 µs an action even with no profiler listening: add them only
        # when one is (torch.profiler sets this flag)
        labelled = profiler_enabled()
        for index, action in enumerate(program):
            if labelled:
                with record_function(f"PP:{action}"):
                    self._do(window, index, action)
            else:
                self._do(window, index, action)
        result = window.result
        if result.losses:
            result.loss = torch.stack(result.losses).mean()
        result.step_time = time.perf_counter() - window.t0
        return result

    # ------------------------------------------------------------- negotiation
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
            self._meta = negotiate(self.schedule, self.stages, self.rank, sample,
                                   group=self.group, device=self.device,
                                   forward_context=self.forward_context)  # fmt: skip
        except NegotiationTimeout as err:  # bounded by the process group's timeout
            raise PipelineTimeout(f"pipeline rank {self.rank}: {err}; the peer may have "
                                  "failed or stalled: check its log") from err  # fmt: skip

    # --------------------------------------------------------------- handlers
    def _do(self, window: _Window, index: int, a: Action) -> None:
        start = time.perf_counter()
        wait = 0.0
        op = a.op
        if op is Op.F:
            wait = self._forward(window, a)
        elif op is Op.B or op is Op.BI:
            last = index in window.last_backward
            self._sync(True, a.stage, last)
            wait = self._backward(a)
            self._sync(False, a.stage, last)
        elif op is Op.BW:
            last = index in window.last_backward
            self._sync(True, a.stage, last)
            saved = self._state.saved.pop((a.stage, a.microbatch))
            assert saved.module is not None
            backward_weight(saved, saved.module)
            self.weights.accumulate(a.stage, saved.module)
            self._sync(False, a.stage, last)
        elif op is Op.SEND_F or op is Op.SEND_B:
            self.transport.send(
                a, self._state.outgoing.pop((a.op, a.stage, a.microbatch)), self.windows
            )
        elif op is Op.RECV_F or op is Op.RECV_B:
            self.transport.post(a, self._meta, self.device)
        else:
            self._weights_action(window, a)
        end = time.perf_counter()
        window.result.records.append(
            ActionRecord(self.rank, index, str(a), start + wait - window.t0, end - window.t0, wait)
        )

    def _weights_action(self, window: _Window, a: Action) -> None:
        """REDUCE, UPDATE and the weight copies."""
        stage, version = a.stage, a.version
        if a.op is Op.REDUCE:
            if self.grad_sync is not None:
                self.grad_sync.reduce(stage)
            return
        assert version is not None, f"{a} carries no version"
        if a.op is Op.UPDATE:
            if a.stage == self._first_stage:
                window.result.updates += 1
            if self.updater is not None:
                self.updater(stage, version)
            self.weights.updated(stage, version)
        elif a.op is Op.STASH:
            self.weights.stash(stage, version)
        elif a.op is Op.PREDICT:
            self.weights.predict(stage, version)
        else:
            self.weights.free(stage, version)

    def _sync(self, before: bool, stage: int, last: bool) -> None:
        if self.grad_sync is None:
            return
        if before:
            self.grad_sync.before_backward(stage, last=last)
        else:
            self.grad_sync.after_backward(stage, last=last)

    def _forward(self, window: _Window, a: Action) -> float:
        s, m = a.stage, a.microbatch
        state, schedule = self._state, self.schedule
        before, after = schedule.prev_stage(s), schedule.next_stage(s)
        wait = 0.0
        if before is None:
            value = state.inputs.pop(m)
        elif schedule.stage_to_rank[before] == self.rank:
            value = state.local.pop((Op.F, s, m))
        else:
            leaves, wait = self.transport.take((Op.RECV_F, s, m), a)
            value = unflatten(self._meta[s], leaves)
        first = before is None
        leaves = [
            t if first else t.detach().requires_grad_(t.is_floating_point()) for t in flatten(value)
        ]
        if not first:
            value = unflatten(self._meta[s], leaves)
        module = self.weights.module(s, a.version)
        with self.forward_context():
            out = module(value)
            if after is None:
                raw = self.loss_fn(out, state.targets.pop(m)).float()
                loss = raw * self.share
        inputs = [] if first else leaves
        if after is None:
            window.result.losses.append(raw.detach())
            window.result.microbatches.append(m)
            scaled = loss * window.loss_scale if window.loss_scale != 1.0 else loss
            state.saved[(s, m)] = Saved(inputs, [scaled], module=module)
            return wait
        out_leaves = flatten(out)
        state.saved[(s, m)] = Saved(
            inputs,
            [t for t in out_leaves if t.requires_grad],
            output_requires=[t.requires_grad for t in out_leaves],
            module=module,
        )
        detached = [t.detach() for t in out_leaves]
        if schedule.stage_to_rank[after] == self.rank:
            state.local[(Op.F, after, m)] = unflatten(self._meta[after], detached)
        else:
            state.outgoing[(Op.SEND_F, s, m)] = detached
        return wait

    def _output_grads(self, a: Action) -> tuple[list[torch.Tensor] | None, float]:
        s, m = a.stage, a.microbatch
        after = self.schedule.next_stage(s)
        if after is None:
            return None, 0.0
        if self.schedule.stage_to_rank[after] == self.rank:
            grads, wait = self._state.local.pop((Op.B, s, m)), 0.0
        else:
            grads, wait = self.transport.take((Op.RECV_B, s, m), a)
        # gradients arrive for every floating output; keep those of outputs that need one
        floating = self._meta[after].grad_indices()
        requires = self._state.saved[(s, m)].output_requires
        return [g for g, i in zip(grads, floating, strict=True) if requires[i]], wait

    def _backward(self, a: Action) -> float:
        s, m = a.stage, a.microbatch
        output_grads, wait = self._output_grads(a)
        saved = self._state.saved[(s, m)]
        module = saved.module
        assert module is not None
        if a.op is Op.B:
            input_grads = backward_full(saved, output_grads)
            del self._state.saved[(s, m)]
            self.weights.accumulate(s, module)
        else:
            if s not in self._exact_split:
                self._exact_split[s] = split_is_exact(saved, module)
            input_grads = backward_input(saved, output_grads, module, exact=self._exact_split[s])
        before = self.schedule.prev_stage(s)
        if before is None:
            return wait
        meta = self._meta[s]
        grads = [
            g
            if g is not None
            else torch.zeros(meta.shapes[i], dtype=meta.torch_dtypes()[i], device=self.device)
            for g, i in zip(
                (input_grads[i] for i in meta.grad_indices()), meta.grad_indices(), strict=True
            )
        ]
        if self.schedule.stage_to_rank[before] == self.rank:
            self._state.local[(Op.B, before, m)] = grads
        else:
            self._state.outgoing[(Op.SEND_B, s, m)] = grads
        return wait
