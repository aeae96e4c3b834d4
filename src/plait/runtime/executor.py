"""The executor: runs one rank's program of a `Schedule` on torch.distributed.

One loop, no schedule-specific branch: each action kind has one handler. Sends are
asynchronous (`isend`; their handles are waited at the end of the step), receives are
posted where the program places them (the lowering pass puts them one compute action
ahead of their consumer) and waited only by the compute that consumes them. Boundary
shapes are negotiated once per input shape and cached. Each micro-batch has its own
autograd graph; the loss of micro-batch i is scaled by its share of the batch so that the
accumulated gradients equal those of one full-batch step. Every action is stamped with
wall-clock times and labelled for the profiler (`PP:2F0`).

torch.distributed.pipelining has an executor too; plait keeps its own because it runs
plait's IR (which the simulator replays as well), carries tuples and dicts across
boundaries whose entries may skip stages, and executes BI/BW as two real passes for any
schedule the validator accepts.
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

from plait.parallel.sync import GradSync
from plait.runtime.backward import (
    Saved,
    backward_full,
    backward_input,
    backward_weight,
    split_is_exact,
)
from plait.runtime.boundary import BoundaryMeta, flatten, unflatten
from plait.schedule import Action, Op, Schedule

__all__ = ["ActionRecord", "PipelineExecutor", "StepResult"]

LossFn = Callable[[Any, Any], torch.Tensor]


@dataclass(frozen=True, slots=True)
class ActionRecord:
    """When one action ran on this rank (seconds from the start of the step)."""

    rank: int
    index: int
    label: str
    start: float  # the handler began (for a compute action: after waiting for its inputs)
    end: float
    wait: float = 0.0  # seconds spent waiting for received data before `start`


@dataclass
class StepResult:
    """One step's outcome on this rank."""

    loss: torch.Tensor | None  # the full-batch loss, on the rank of the last stage
    losses: list[torch.Tensor] = field(default_factory=list)  # scaled per micro-batch losses
    records: list[ActionRecord] = field(default_factory=list)
    step_time: float = 0.0


@dataclass
class _Pending:
    """A posted receive: its buffers and the handles to wait on."""

    buffers: list[torch.Tensor]
    works: list[Any]


class PipelineExecutor:
    """Executes this rank's program of `schedule` for its `stages` (global stage -> module).

    `group` is the pipeline process group; schedule rank r is group rank r. The loss
    function takes (output of the last stage, targets of the micro-batch) and returns the
    micro-batch's mean loss.
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
    ) -> None:
        mine = set(schedule.stages_of(rank))
        if set(stages) != mine:
            raise ValueError(
                f"rank {rank} runs stages {sorted(mine)} of the schedule but was given modules "
                f"for stages {sorted(stages)}"
            )
        self.schedule = schedule
        self.stages = stages
        self.rank = rank
        self.loss_fn = loss_fn
        self.group = group
        self.device = torch.device(device)
        self.program = schedule.ranks[rank]
        self.last_stage = schedule.num_stages - 1
        self._meta: dict[int, BoundaryMeta] = {}  # stage -> meta of its input boundary
        self._meta_key: object = None
        self._negotiated = False
        self._exact_split: dict[int, bool] = {}
        self.grad_sync = grad_sync
        self.forward_context = forward_context or contextlib.nullcontext
        # the action after which a stage's weight gradients are complete for the step
        self._last_weight_action = {
            a.stage: i for i, a in enumerate(self.program) if a.op in (Op.B, Op.BW)
        }

    # ------------------------------------------------------------------ public
    def step(
        self,
        inputs: Sequence[Any] | None = None,
        targets: Sequence[Any] | None = None,
        *,
        loss_scale: float = 1.0,
    ) -> StepResult:
        """Run one step. `inputs` (micro-batches for stage 0) are needed only on the rank of
        stage 0, `targets` only on the rank of the last stage; elsewhere pass None.
        Backward runs on the loss times `loss_scale` (fp16 loss scaling); the reported
        loss is unscaled."""
        m = self.schedule.num_microbatches
        if 0 in self.stages and (inputs is None or len(inputs) != m):
            raise ValueError(f"rank {self.rank} holds stage 0 and needs {m} input micro-batches")
        if self.last_stage in self.stages and (targets is None or len(targets) != m):
            raise ValueError(f"rank {self.rank} holds the last stage and needs {m} targets")
        self._negotiate(inputs)
        state = _StepState(inputs, targets, time.perf_counter(), loss_scale)
        # labels cost ~15 µs an action even with no profiler listening: add them only
        # when one is (torch.profiler sets this flag)
        labelled = torch.autograd.profiler._is_profiler_enabled
        for index, action in enumerate(self.program):
            if labelled:
                with record_function(f"PP:{action}"):
                    self._run(state, index, action)
            else:
                self._run(state, index, action)
        for work in state.send_works:
            work.wait()
        result = StepResult(loss=None, losses=state.losses, records=state.records)
        if state.losses:
            result.loss = torch.stack(state.losses).sum()
        result.step_time = time.perf_counter() - state.t0
        return result

    # ------------------------------------------------------------- negotiation
    def _negotiate(self, inputs: Sequence[Any] | None) -> None:
        """Learn every boundary's structure and shapes once per input shape.

        Stages are probed in increasing order with one forward each under no_grad, in
        eval mode and with the RNG state restored, so the probe changes nothing. A rank
        learns the input shape of micro-batch 0 from the previous stage's rank.
        """
        key = BoundaryMeta.of(inputs[0]) if inputs is not None else None
        if self._negotiated and (key is None or key == self._meta_key):
            return
        self._negotiated, self._meta_key = True, key
        if self.schedule.num_stages == 1:  # no boundary to describe
            return
        place = self.schedule.stage_to_rank
        local: dict[int, object] = {}
        for s in sorted(self.stages):
            if s == 0:
                assert inputs is not None
                value: object = inputs[0]
            elif place[s - 1] == self.rank:
                value = local[s - 1]
            else:
                box: list[Any] = [None]
                dist.recv_object_list(
                    box, group=self.group, group_src=place[s - 1], device=self._object_device()
                )
                self._meta[s] = box[0]
                value = unflatten(box[0], [t.zero_() for t in box[0].empty(self.device)])
            local[s] = out = self._probe(s, value)
            if s == self.last_stage:
                continue
            # self._meta[s + 1] is the boundary between s and s + 1, known to both sides
            self._meta[s + 1] = BoundaryMeta.of(out)
            if place[s + 1] != self.rank:
                dist.send_object_list(
                    [self._meta[s + 1]],
                    group=self.group,
                    group_dst=place[s + 1],
                    device=self._object_device(),
                )

    def _object_device(self) -> torch.device | None:
        return self.device if self.device.type == "cuda" else None

    def _probe(self, stage: int, value: object) -> object:
        module = self.stages[stage]
        was_training = module.training
        devices = [self.device] if self.device.type == "cuda" else []
        try:
            module.eval()
            with torch.no_grad(), torch.random.fork_rng(devices=devices):
                return module(value)
        finally:
            module.train(was_training)

    # --------------------------------------------------------------- handlers
    def _run(self, state: _StepState, index: int, a: Action) -> None:
        start = time.perf_counter()
        wait = 0.0
        if a.op is Op.F:
            wait = self._forward(state, a)
        elif a.op in (Op.B, Op.BI):
            last = self._last_weight_action.get(a.stage) == index
            self._sync(True, a.stage, last)
            wait = self._backward(state, a)
            self._sync(False, a.stage, last)
        elif a.op is Op.BW:
            last = self._last_weight_action[a.stage] == index
            self._sync(True, a.stage, last)
            backward_weight(state.saved.pop((a.stage, a.microbatch)), self.stages[a.stage])
            self._sync(False, a.stage, last)
        elif a.op in (Op.SEND_F, Op.SEND_B):
            self._send(state, a)
        else:
            self._post_receive(state, a)
        end = time.perf_counter()
        state.records.append(
            ActionRecord(self.rank, index, str(a), start + wait - state.t0, end - state.t0, wait)
        )

    def _sync(self, before: bool, stage: int, last: bool) -> None:
        if self.grad_sync is None:
            return
        if before:
            self.grad_sync.before_backward(stage, last=last)
        else:
            self.grad_sync.after_backward(stage, last=last)

    def _take(
        self, state: _StepState, key: tuple[Op, int, int]
    ) -> tuple[list[torch.Tensor], float]:
        """The data of a posted receive, waiting for it; returns (tensors, seconds waited)."""
        pending = state.received.pop(key)
        t = time.perf_counter()
        for work in pending.works:
            work.wait()
        return pending.buffers, time.perf_counter() - t

    def _forward(self, state: _StepState, a: Action) -> float:
        s, m = a.stage, a.microbatch
        wait = 0.0
        if s == 0:
            value = state.inputs[m]  # type: ignore[index]
        elif self.schedule.stage_to_rank[s - 1] == self.rank:
            value = state.local.pop((Op.F, s, m))
        else:
            leaves, wait = self._take(state, (Op.RECV_F, s, m))
            value = unflatten(self._meta[s], leaves)
        leaves = [
            t.detach().requires_grad_(t.is_floating_point()) if s > 0 else t for t in flatten(value)
        ]
        if s > 0:
            value = unflatten(self._meta[s], leaves)
        with self.forward_context():
            out = self.stages[s](value)
            if s == self.last_stage:
                share = 1.0 / self.schedule.num_microbatches
                loss = self.loss_fn(out, state.targets[m]).float() * share  # type: ignore[index]
        if s == self.last_stage:
            state.losses.append(loss.detach())
            scaled = loss * state.loss_scale if state.loss_scale != 1.0 else loss
            state.saved[(s, m)] = Saved(leaves if s > 0 else [], [scaled])
            return wait
        out_leaves = flatten(out)
        grad_leaves = [t for t in out_leaves if t.requires_grad]
        state.saved[(s, m)] = Saved(
            leaves if s > 0 else [],
            grad_leaves,
            output_requires=[t.requires_grad for t in out_leaves],
        )
        detached = [t.detach() for t in out_leaves]
        if self.schedule.stage_to_rank[s + 1] == self.rank:
            state.local[(Op.F, s + 1, m)] = unflatten(self._meta[s + 1], detached)
        else:
            state.outgoing[(Op.SEND_F, s, m)] = detached
        return wait

    def _output_grads(
        self, state: _StepState, a: Action
    ) -> tuple[list[torch.Tensor] | None, float]:
        s, m = a.stage, a.microbatch
        if s == self.last_stage:
            return None, 0.0
        if self.schedule.stage_to_rank[s + 1] == self.rank:
            grads, wait = state.local.pop((Op.B, s, m)), 0.0
        else:
            grads, wait = self._take(state, (Op.RECV_B, s, m))
        # gradients arrive for every floating output; keep those of outputs that need one
        floating = self._meta[s + 1].grad_indices()
        requires = state.saved[(s, m)].output_requires
        return [g for g, i in zip(grads, floating, strict=True) if requires[i]], wait

    def _backward(self, state: _StepState, a: Action) -> float:
        s, m = a.stage, a.microbatch
        output_grads, wait = self._output_grads(state, a)
        saved = state.saved[(s, m)]
        module = self.stages[s]
        if a.op is Op.B:
            input_grads = backward_full(saved, output_grads)
            del state.saved[(s, m)]
        else:
            if s not in self._exact_split:
                self._exact_split[s] = split_is_exact(saved, module)
            input_grads = backward_input(saved, output_grads, module, exact=self._exact_split[s])
        if s == 0:
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
        if self.schedule.stage_to_rank[s - 1] == self.rank:
            state.local[(Op.B, s - 1, m)] = grads
        else:
            state.outgoing[(Op.SEND_B, s, m)] = grads
        return wait

    def _peer(self, a: Action) -> int:
        neighbour = a.stage + 1 if a.op in (Op.SEND_F, Op.RECV_B) else a.stage - 1
        return self.schedule.stage_to_rank[neighbour]

    def _send(self, state: _StepState, a: Action) -> None:
        tensors = state.outgoing.pop((a.op, a.stage, a.microbatch))
        peer = self._peer(a)
        for t in tensors:
            state.send_works.append(dist.isend(t.contiguous(), group=self.group, group_dst=peer))

    def _post_receive(self, state: _StepState, a: Action) -> None:
        if a.op is Op.RECV_F:
            buffers = self._meta[a.stage].empty(self.device)
        else:
            buffers = self._meta[a.stage + 1].empty_grads(self.device)
        peer = self._peer(a)
        works = [dist.irecv(b, group=self.group, group_src=peer) for b in buffers]
        state.received[(a.op, a.stage, a.microbatch)] = _Pending(buffers, works)


@dataclass
class _StepState:
    inputs: Sequence[Any] | None
    targets: Sequence[Any] | None
    t0: float
    loss_scale: float
    saved: dict[tuple[int, int], Saved] = field(default_factory=dict)
    local: dict[tuple[Op, int, int], Any] = field(default_factory=dict)
    outgoing: dict[tuple[Op, int, int], list[torch.Tensor]] = field(default_factory=dict)
    received: dict[tuple[Op, int, int], _Pending] = field(default_factory=dict)
    send_works: list[Any] = field(default_factory=list)
    losses: list[torch.Tensor] = field(default_factory=list)
    records: list[ActionRecord] = field(default_factory=list)
