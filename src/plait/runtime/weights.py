"""The weight store: per stage, the live weights and the copies of other versions that an
asynchronous schedule computes on, made and dropped where the program says (the STASH,
PREDICT and FREE actions that `plait.schedule.versions` derives from the versions).

A copy is a whole replica of the stage module (a deep copy made once and reused), so that
everything the forward does, recomputation in the backward included, reads the copy's
weights. Replicas share the live module's buffers (running statistics keep one history).
A micro-batch's gradients land in the replica it computed on; after its last backward they
are added to the live weights' `.grad`, where the optimizer and the data-parallel
reduction expect them. Why not `torch.func.functional_call`: it swaps weights only for the
duration of the call, so a recomputed forward in the backward would read the live ones.
"""

from __future__ import annotations

import copy
from collections import defaultdict
from collections.abc import Callable, Mapping

import torch
from torch import nn

__all__ = ["Predictor", "WeightStore"]

# (stage, live module, module to fill, number of updates to look ahead)
Predictor = Callable[[int, nn.Module, nn.Module, int], None]


class WeightStore:
    """Live stage modules and their copies, keyed by (stage, version)."""

    def __init__(self, stages: Mapping[int, nn.Module], *, predictor: Predictor | None = None):
        self.live = dict(stages)
        self.version = dict.fromkeys(stages, 0)
        self.copies: dict[tuple[int, int], nn.Module] = {}
        self.predicted: set[tuple[int, int]] = set()
        self.predictor = predictor
        self._spare: dict[int, list[nn.Module]] = defaultdict(list)
        self.peak_versions = dict.fromkeys(stages, 1)  # distinct versions alive at once
        self.peak_copies = 0  # replicas alive at once on this rank

    def module(self, stage: int, version: int | None) -> nn.Module:
        """The module computing on `version` of `stage` (None: the live weights)."""
        if version is not None:
            held = self.copies.get((stage, version))
            if held is not None:
                return held
            if version != self.version[stage]:
                raise RuntimeError(
                    f"stage {stage} holds version {self.version[stage]} and copies "
                    f"{sorted(v for s, v in self.copies if s == stage)}, not version {version}: "
                    "the program lacks a STASH or PREDICT (was it validated?)"
                )
        return self.live[stage]

    @torch.no_grad()
    def stash(self, stage: int, version: int) -> None:
        """Keep the live weights of `stage` as `version`."""
        replica = self._replica(stage)
        for mine, live in zip(replica.parameters(), self.live[stage].parameters(), strict=True):
            mine.copy_(live)
        self._keep(stage, version, replica)

    @torch.no_grad()
    def predict(self, stage: int, version: int) -> None:
        """Weights of `stage` predicted for `version` from the live ones."""
        if self.predictor is None:
            raise RuntimeError("the program predicts weights but the executor has no predictor")
        replica = self._replica(stage)
        self.predictor(stage, self.live[stage], replica, version - self.version[stage])
        self.predicted.add((stage, version))
        self._keep(stage, version, replica)

    def free(self, stage: int, version: int) -> None:
        replica = self.copies.pop((stage, version))
        self.predicted.discard((stage, version))
        for p in replica.parameters():
            p.grad = None
        self._spare[stage].append(replica)

    def updated(self, stage: int, version: int) -> None:
        """The optimizer has turned the live weights of `stage` into `version`."""
        self.version[stage] = version
        self._measure(stage)

    @torch.no_grad()
    def accumulate(self, stage: int, module: nn.Module) -> None:
        """Add the gradients a replica of `stage` holds to the live weights' `.grad`."""
        if module is self.live[stage]:
            return
        for mine, live in zip(module.parameters(), self.live[stage].parameters(), strict=True):
            if mine.grad is None:
                continue
            if live.grad is None:
                live.grad = mine.grad
            else:
                live.grad.add_(mine.grad)
            mine.grad = None

    def _replica(self, stage: int) -> nn.Module:
        spare = self._spare[stage]
        if spare:
            return spare.pop()
        live = self.live[stage]
        replica = copy.deepcopy(live)
        for name, buffer in live.named_buffers():
            owner, _, leaf = name.rpartition(".")
            setattr(replica.get_submodule(owner) if owner else replica, leaf, buffer)
        return replica

    def _keep(self, stage: int, version: int, replica: nn.Module) -> None:
        self.copies[(stage, version)] = replica
        self.peak_copies = max(self.peak_copies, len(self.copies))
        self._measure(stage)

    def _measure(self, stage: int) -> None:
        """Distinct versions of `stage` alive: the live one, and every copy but a stash of
        the live version (the same weights until the next update)."""
        current = (stage, self.version[stage])
        same = current in self.copies and current not in self.predicted
        versions = 1 + sum(1 for key in self.copies if key[0] == stage) - same
        self.peak_versions[stage] = max(self.peak_versions[stage], versions)
