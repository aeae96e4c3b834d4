"""Exact single-process training under a schedule's weight-version rules.

What a pipeline computes depends only on its program (`plait.schedule.versions`): the
version of each stage that every micro-batch computes on (or the version it is predicted
from), and the micro-batches each update applies. `version_plan` reads both from the
schedule's run, and `Emulator` trains on them in one process: every micro-batch runs once
through the whole model assembled from its stages' versions, its gradient is added to its
update's, and each stage's optimizer steps the latest weights, as the distributed run's
do. The losses and weights equal the distributed run's (the tests check both this and the
runtime against an independent emulator of the papers' rules), at the cost of one
process, which is how `plait experiment staleness` reaches 16 stages on one machine.

Why not run the runtime itself on one process: its stages exchange activations through
torch.distributed, one process per pipeline rank; here the stages never meet.
"""

from __future__ import annotations

import copy
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch
from torch import nn

from plait.blocks import as_blocks, equal_split
from plait.runtime.predict import update_direction
from plait.schedule import Op, Schedule, unroll

__all__ = ["Emulator", "VersionPlan", "version_plan"]

LossFn = Callable[[Any, Any], torch.Tensor]


@dataclass(frozen=True)
class VersionPlan:
    """What a run of a schedule computes, stage by stage and micro-batch by micro-batch.

    `versions[(stage, x)]` = (version, base): micro-batch x computes on `version` of the
    stage, exact when `base` is None, else predicted from version `base`. `groups[u]` are
    the micro-batches whose gradients update u applies (the same on every stage).
    """

    num_stages: int
    versions: dict[tuple[int, int], tuple[int, int | None]]
    groups: tuple[tuple[int, ...], ...]

    @cached_property
    def predicts(self) -> bool:
        """Whether any micro-batch computes on predicted weights."""
        return any(base is not None for _, base in self.versions.values())

    @cached_property
    def lag(self) -> int:
        """The oldest version any micro-batch computes on, in updates behind its group."""
        return max(self.stage_lags, default=0)

    @cached_property
    def stage_lags(self) -> tuple[int, ...]:
        """Per stage, the most updates a micro-batch's version (or the version it is
        predicted from) lies behind the update that applies it: the stage's staleness."""
        group_of = {x: u for u, group in enumerate(self.groups) for x in group}
        lags = [0] * self.num_stages
        for (s, x), (v, base) in self.versions.items():
            lags[s] = max(lags[s], group_of[x] - (v if base is None else base))
        return tuple(lags)


def version_plan(schedule: Schedule, num_windows: int) -> VersionPlan:
    """The versions and update groups of `num_windows` windows of `schedule` (drain
    included), read from the run the runtime executes."""
    run = unroll(schedule, num_windows).schedule
    versions: dict[tuple[int, int], tuple[int, int | None]] = {}
    updates: dict[int, list[tuple[int, ...]]] = defaultdict(list)
    for program in run.ranks:
        current: dict[int, int] = defaultdict(int)
        predicted: dict[tuple[int, int], int] = {}  # (stage, version) -> predicted from
        done: dict[int, list[int]] = defaultdict(list)
        for a in program:
            s = a.stage
            if a.op is Op.PREDICT and a.version is not None:
                predicted[(s, a.version)] = current[s]
            elif a.op is Op.FREE and a.version is not None:
                predicted.pop((s, a.version), None)
            elif a.op is Op.F:
                v = current[s] if a.version is None else a.version
                versions[(s, a.microbatch)] = (v, predicted.get((s, v)))
            elif a.op is Op.B or a.op is Op.BW:
                done[s].append(a.microbatch)
            elif a.op is Op.UPDATE:
                updates[s].append(tuple(sorted(done.pop(s, []))))
                current[s] += 1
    stages = range(schedule.num_stages)
    groups = tuple(updates[0]) if updates else ()
    if any(tuple(updates[s]) != groups for s in stages):
        raise ValueError(
            f"the stages of {schedule.kind!r} update from different micro-batches: the "
            "emulator needs every update to apply the same micro-batches on every stage"
        )
    return VersionPlan(schedule.num_stages, versions, groups)


class Emulator:
    """A model cut into stages, each with the history of its versions, trained one update
    at a time under a `VersionPlan`."""

    def __init__(
        self,
        model: nn.Module,
        num_stages: int,
        optimizer: Callable[[Any], torch.optim.Optimizer],
        loss_fn: LossFn,
        *,
        sizes: Sequence[int] | None = None,
    ) -> None:
        self.model = model  # trained in place: its weights are the latest versions
        self.scratch = copy.deepcopy(model)  # computes on the versions a micro-batch needs
        self.loss_fn = loss_fn
        blocks, scratch = as_blocks(model), as_blocks(self.scratch)
        sizes = list(sizes) if sizes is not None else equal_split(len(blocks), num_stages)
        cuts = [sum(sizes[:s]) for s in range(num_stages + 1)]
        self.params = [_params(blocks[cuts[s] : cuts[s + 1]]) for s in range(num_stages)]
        self.scratch_params = [_params(scratch[cuts[s] : cuts[s + 1]]) for s in range(num_stages)]
        # one optimizer for every stage, a parameter group each: all stages step together
        # here, and the optimizers plait supports update each parameter on its own, as
        # per-stage ones would; a stage's learning rate is its group's
        self.optimizer = optimizer([{"params": ps} for ps in self.params])
        self.base_lr = [float(g["lr"]) for g in self.optimizer.param_groups]
        self.history: list[dict[int, list[torch.Tensor]]] = [{} for _ in range(num_stages)]
        self.directions: list[dict[int, list[torch.Tensor] | None]] = [
            {} for _ in range(num_stages)
        ]
        self.updates = 0
        self.predicts = True  # directions are kept until a plan says none is needed
        for s in range(num_stages):
            self._remember(s)

    def train(
        self,
        plan: VersionPlan,
        microbatch: Callable[[int], tuple[Any, Any]],
        *,
        after_update: Callable[[int, list[float]], None] | None = None,
        lr_scale: Callable[[int, int], float] | None = None,
    ) -> list[float]:
        """Run every update of `plan`; `microbatch(x)` gives micro-batch x. Returns the
        loss of each micro-batch in the order computed; `after_update(u, losses)` is called
        after update u with its micro-batches' losses; `lr_scale(stage, u)` multiplies the
        stage's learning rate from update u on (a schedule or a remedy for staleness)."""
        out, lag = [], plan.lag
        self.predicts = plan.predicts
        for u, group in enumerate(plan.groups):
            if lr_scale is not None:
                for s, g in enumerate(self.optimizer.param_groups):
                    g["lr"] = self.base_lr[s] * lr_scale(s, u)
            losses = [self._gradient(plan, x, microbatch(x), 1.0 / len(group)) for x in group]
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.updates += 1
            for s in range(len(self.params)):
                self._remember(s)
                self._forget(s, self.updates - lag - 1)
            out += losses
            if after_update is not None:
                after_update(u, losses)
        return out

    # ------------------------------------------------------------------ inside
    def _gradient(self, plan: VersionPlan, x: int, batch: tuple[Any, Any], share: float) -> float:
        with torch.no_grad():
            for s, params in enumerate(self.scratch_params):
                version, base = plan.versions[(s, x)]
                for q, w in zip(params, self._weights(s, version, base), strict=True):
                    q.copy_(w)
        self.scratch.zero_grad(set_to_none=True)
        inputs, targets = batch
        loss = self.loss_fn(self.scratch(inputs), targets)
        torch.autograd.backward(loss * share)
        for live, scratch in zip(self.params, self.scratch_params, strict=True):
            for p, q in zip(live, scratch, strict=True):
                if q.grad is not None:
                    p.grad = q.grad.clone() if p.grad is None else p.grad.add_(q.grad)
        return float(loss.detach())

    def _weights(self, s: int, version: int, base: int | None) -> list[torch.Tensor]:
        if base is None:
            return self.history[s][version]
        weights, directions = self.history[s][base], self.directions[s][base]
        if directions is None:
            return weights
        lr = float(self.optimizer.param_groups[s]["lr"])
        distance = version - base
        return [w - distance * lr * d for w, d in zip(weights, directions, strict=True)]

    def _remember(self, s: int) -> None:
        optimizer = self.optimizer
        self.history[s][self.updates] = [p.detach().clone() for p in self.params[s]]
        if not self.predicts:
            self.directions[s][self.updates] = None
            return
        group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
        directions = [update_direction(optimizer, group_of[id(p)], p) for p in self.params[s]]
        self.directions[s][self.updates] = (
            None if any(d is None for d in directions) else [d.clone() for d in directions]  # type: ignore[union-attr]
        )

    def _forget(self, s: int, below: int) -> None:
        for version in [v for v in self.history[s] if v < below]:
            del self.history[s][version]
            del self.directions[s][version]


def _params(blocks: Sequence[nn.Module]) -> list[nn.Parameter]:
    return [p for block in blocks for p in block.parameters() if p.requires_grad]
