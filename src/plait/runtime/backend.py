"""The one backend: runs a lowered program (`plait.schedule.lower.Program`) on this rank.

Each step kind has one handler and no schedule kind has a branch. State that outlives a
window lives in `State` (micro-batches waiting for their first stage, activations waiting
for their backward, values handed between stages of this rank, outputs waiting to be
sent); messages in flight live in the `Transport`; weight versions in the `WeightStore`.
Training runs forwards with autograd and keeps what each backward needs; evaluation
(`Mode.evaluate`) runs a forward-only program without gradients and sums the loss and the
metrics of the micro-batches its last stages finish. Each step is timed by the device's
`ActionClock` (marks, resolved after the step's one synchronisation) and labelled for the
profiler (`PP:2F0`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.autograd.profiler import record_function

from plait.compat import profiler_enabled, pytree
from plait.device import ActionClock
from plait.runtime.backward import (
    Saved,
    backward_full,
    backward_input,
    backward_weight,
    split_is_exact,
)
from plait.runtime.boundary import BoundaryMeta, flatten, unflatten
from plait.runtime.transport import Transport
from plait.runtime.weights import WeightStore
from plait.schedule import Action, Op, Schedule
from plait.schedule.lower import LOCAL, LOSS, REMOTE, Program, Step

if TYPE_CHECKING:
    from plait.runtime.sync import GradSync

__all__ = ["Backend", "MetricFn", "State", "Window"]

LossFn = Callable[[Any, Any], torch.Tensor]
Updater = Callable[[int, int], None]  # (stage, version it produces): the optimizer step
# (output, targets) -> the sum over the samples, a tensor or a number
MetricFn = Callable[[Any, Any], torch.Tensor | float]


@dataclass
class State:
    """What outlives a window: data waiting for its consumer, activations waiting for their
    backward, outputs waiting for their send."""

    inputs: dict[int, Any] = field(default_factory=dict)
    targets: dict[int, Any] = field(default_factory=dict)
    saved: dict[tuple[int, int], Saved] = field(default_factory=dict)
    local: dict[tuple[Op, int, int], Any] = field(default_factory=dict)
    outgoing: dict[tuple[Op, int, int], list[torch.Tensor]] = field(default_factory=dict)


@dataclass
class Window:
    """One run of a program: its loss scale, what it gathers, and its clock marks."""

    loss_scale: float = 1.0
    window: int = 0  # the window's number in the stream (sends are settled by it)
    losses: list[torch.Tensor] = field(default_factory=list)  # finished micro-batches'
    microbatches: list[int] = field(default_factory=list)
    updates: int = 0
    # per step: (program index, label, start mark, ready mark, end mark)
    # (position, action, start, ready, end): the action is formatted only when read
    marks: list[tuple[int, Any, Any, Any, Any]] = field(default_factory=list)
    waits: list[float] = field(default_factory=list)  # host seconds waiting, per step
    sums: torch.Tensor | None = None  # evaluation: [loss × samples, samples, metric sums]
    metrics: Mapping[str, MetricFn] = field(default_factory=dict)


class Backend:
    """Runs lowered programs for this rank's `stages` (global stage -> module)."""

    def __init__(
        self,
        schedule: Schedule,
        stages: Mapping[int, nn.Module],
        *,
        loss_fn: LossFn,
        device: torch.device,
        grad_sync: GradSync | None,
        forward_context: Callable[[], AbstractContextManager[Any]],
        updater: Updater | None,
        weights: WeightStore,
        clock: ActionClock,
    ) -> None:
        self.schedule, self.stages, self.loss_fn = schedule, stages, loss_fn
        self.device, self.grad_sync, self.updater = device, grad_sync, updater
        self.forward_context, self.weights, self.clock = forward_context, weights, clock
        u, m = schedule.updates_per_window, schedule.num_microbatches
        self.share = u / m if u else 1.0 / m  # of an update's micro-batches, one's weight
        self.first_stage = min(stages)
        self.meta: dict[int, BoundaryMeta] = {}  # stage -> meta of its input boundary
        self._exact_split: dict[int, bool] = {}
        # micro-batch id -> the context its forward and backward run in (the engine's
        # keyed dropout, `plait.keyed`); None: nothing to enter
        self.draw: Callable[[int], AbstractContextManager[Any]] | None = None

    # ---------------------------------------------------------------- running
    def run(self, program: Program, state: State, transport: Transport, window: Window) -> Window:
        """Run `program`'s steps in order; `window` collects what they produce."""
        labelled = profiler_enabled()
        evaluating = window.sums is not None
        for step in program.steps:
            context = record_function(f"{'EVAL' if evaluating else 'PP'}:{step.action}") \
                if labelled else contextlib.nullcontext()  # fmt: skip
            with context:
                start = self.clock.mark()
                wait, ready = self._step(step, state, transport, window)
                end = self.clock.mark()
            window.marks.append((step.position, step.action, start,
                                 ready if ready is not None else start, end))  # fmt: skip
            window.waits.append(wait)
        return window

    def _step(
        self, step: Step, state: State, transport: Transport, window: Window
    ) -> tuple[float, Any]:
        """Run one step: (host seconds waited for data, the clock mark once it was there)."""
        a, op = step.action, step.action.op
        if op is Op.F:
            with self._drawing(a.microbatch):
                return self._forward(step, state, transport, window)
        if op is Op.B or op is Op.BI:
            self._sync(True, a.stage, step.completes)
            with self._drawing(a.microbatch):  # a recomputed forward draws as the first
                found = self._backward(step, state, transport)
            self._sync(False, a.stage, step.completes)
            return found
        if op is Op.BW:
            self._sync(True, a.stage, step.completes)
            saved = state.saved.pop((a.stage, a.microbatch))
            assert saved.module is not None
            with self._drawing(a.microbatch):
                backward_weight(saved, saved.module)
            self.weights.accumulate(a.stage, saved.module)
            self._sync(False, a.stage, step.completes)
        elif step.batch is not None:
            self._messages(step, state, transport, window)
        elif op not in (Op.SEND_F, Op.SEND_B, Op.RECV_F, Op.RECV_B):
            self._weights(a, window)
        return 0.0, None

    def _drawing(self, microbatch: int) -> AbstractContextManager[Any]:
        return _NULL if self.draw is None else self.draw(microbatch)

    def _messages(self, step: Step, state: State, transport: Transport, window: Window) -> None:
        """Issue the batch that starts at `step`: its sends, or its receive."""
        assert step.batch is not None
        batch = step.batch
        first = batch.messages[0]
        if first.is_send:
            tensors = [state.outgoing.pop(m.key) for m in batch.messages]
            transport.send(batch, tensors, window.window)
            return
        a = first.action
        if a.op is Op.RECV_F:
            buffers = self.meta[a.stage].empty(self.device)
        else:
            buffers = self.meta[first.peer_stage].empty_grads(self.device)
        transport.post(first, buffers)

    def _weights(self, a: Action, window: Window) -> None:
        """REDUCE, UPDATE and the weight copies."""
        stage, version = a.stage, a.version
        if a.op is Op.REDUCE:
            if self.grad_sync is not None:
                self.grad_sync.reduce(stage)
            return
        assert version is not None, f"{a} carries no version"
        if a.op is Op.UPDATE:
            if stage == self.first_stage:
                window.updates += 1
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

    # ---------------------------------------------------------------- forward
    def _input(self, step: Step, state: State, transport: Transport) -> tuple[Any, float, Any]:
        """A forward's input: (value, host seconds waited, the mark once it was there)."""
        a = step.action
        s, m = a.stage, a.microbatch
        if step.source == REMOTE:
            leaves, wait = transport.take((Op.RECV_F, s, m), a)
            return unflatten(self.meta[s], leaves), wait, self.clock.mark()
        if step.source == LOCAL:
            return state.local.pop((Op.F, s, m)), 0.0, None
        return state.inputs.pop(m), 0.0, None

    def _forward(
        self, step: Step, state: State, transport: Transport, window: Window
    ) -> tuple[float, Any]:
        a = step.action
        s, m = a.stage, a.microbatch
        value, wait, ready = self._input(step, state, transport)
        if window.sums is not None:
            self._evaluate(step, value, state, window)
            return wait, ready
        first = step.source not in (LOCAL, REMOTE)
        leaves = [
            t if first else t.detach().requires_grad_(t.is_floating_point()) for t in flatten(value)
        ]
        if not first:
            value = unflatten(self.meta[s], leaves)
        module = self.weights.module(s, a.version)
        with self.forward_context():
            out = module(value)
            if step.target == LOSS:
                raw = self.loss_fn(out, state.targets.pop(m)).float()
                loss = raw * self.share
        inputs = [] if first else leaves
        if step.target == LOSS:
            window.losses.append(raw.detach())
            window.microbatches.append(m)
            scaled = loss * window.loss_scale if window.loss_scale != 1.0 else loss
            state.saved[(s, m)] = Saved(inputs, [scaled], module=module)
            return wait, ready
        out_leaves = flatten(out)
        state.saved[(s, m)] = Saved(
            inputs,
            [t for t in out_leaves if t.requires_grad],
            output_requires=[t.requires_grad for t in out_leaves],
            module=module,
        )
        self._hand_on(step, [t.detach() for t in out_leaves], state, Op.F)
        return wait, ready

    def _hand_on(self, step: Step, leaves: list[torch.Tensor], state: State, op: Op) -> None:
        """A forward's output (`op` F) or a backward's input gradients (B) to the stage that
        consumes them: on this rank, or into the outgoing message."""
        a = step.action
        s, m = a.stage, a.microbatch
        nxt = self.schedule.next_stage(s) if op is Op.F else self.schedule.prev_stage(s)
        assert nxt is not None
        if step.target == LOCAL:
            value = unflatten(self.meta[nxt], leaves) if op is Op.F else leaves
            state.local[(op, nxt, m)] = value
        else:
            send = Op.SEND_F if op is Op.F else Op.SEND_B
            state.outgoing[(send, s, m)] = leaves

    def _evaluate(self, step: Step, value: Any, state: State, window: Window) -> None:
        """A forward of evaluation: no gradient; the last stage adds its loss and metrics."""
        a = step.action
        with torch.no_grad(), self.forward_context():
            out = self.stages[a.stage](value)
            if step.target == LOSS:
                target = state.targets.pop(a.microbatch)
                loss = self.loss_fn(out, target).double()
                values = [
                    torch.as_tensor(fn(out, target), dtype=torch.float64, device=loss.device)
                    for fn in window.metrics.values()
                ]
        if step.target != LOSS:
            self._hand_on(step, [t.detach() for t in flatten(out)], state, Op.F)
            return
        sums = window.sums
        assert sums is not None
        samples = _samples(target)
        sums[0] += loss.to(sums.device) * samples
        sums[1] += samples
        for i, v in enumerate(values):
            sums[2 + i] += v.to(sums.device)

    # --------------------------------------------------------------- backward
    def _output_grads(
        self, step: Step, state: State, transport: Transport
    ) -> tuple[list[torch.Tensor] | None, float, Any]:
        a = step.action
        s, m = a.stage, a.microbatch
        if step.source == LOSS:
            return None, 0.0, None
        after = self.schedule.next_stage(s)
        assert after is not None
        ready = None
        if step.source == LOCAL:
            grads, wait = state.local.pop((Op.B, s, m)), 0.0
        else:
            grads, wait = transport.take((Op.RECV_B, s, m), a)
            ready = self.clock.mark()
        # gradients arrive for every floating output; keep those of outputs that need one
        floating = self.meta[after].grad_indices()
        requires = state.saved[(s, m)].output_requires
        return [g for g, i in zip(grads, floating, strict=True) if requires[i]], wait, ready

    def _backward(self, step: Step, state: State, transport: Transport) -> tuple[float, Any]:
        a = step.action
        s, m = a.stage, a.microbatch
        output_grads, wait, ready = self._output_grads(step, state, transport)
        saved = state.saved[(s, m)]
        module = saved.module
        assert module is not None
        if a.op is Op.B:
            input_grads = backward_full(saved, output_grads)
            del state.saved[(s, m)]
            self.weights.accumulate(s, module)
        else:
            if s not in self._exact_split:
                self._exact_split[s] = split_is_exact(saved, module)
            input_grads = backward_input(saved, output_grads, module, exact=self._exact_split[s])
        if step.target not in (LOCAL, REMOTE):
            return wait, ready
        meta = self.meta[s]
        dtypes = meta.torch_dtypes()
        grads = [
            g if g is not None else torch.zeros(meta.shapes[i], dtype=dtypes[i], device=self.device)
            for g, i in zip(
                (input_grads[i] for i in meta.grad_indices()), meta.grad_indices(), strict=True
            )
        ]
        self._hand_on(step, grads, state, Op.B)
        return wait, ready


_NULL = contextlib.nullcontext()


def _samples(target: Any) -> int:
    leaves = [t for t in pytree.tree_leaves(target) if isinstance(t, torch.Tensor)]
    return int(leaves[0].shape[0]) if leaves else 1


def split_microbatch_inputs(
    schedule: Schedule, stages: Sequence[int], base: int, values: Sequence[Any], last: bool
) -> dict[int, Any]:
    """The micro-batches (global ids from `base`) whose first (or, `last`, last) stage is
    one of `stages`: only what a stage of this rank consumes is kept."""
    mine = set(stages)
    out = {}
    for j, value in enumerate(values):
        path = schedule.path(base + j)
        if (path[-1] if last else path[0]) in mine:
            out[base + j] = value
    return out
