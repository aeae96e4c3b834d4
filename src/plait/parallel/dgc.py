"""Deep Gradient Compression (Lin, Han, Mao, Wang and Dally, ICLR 2018) as a comm hook.

DGC sends, of each tensor, only the largest RATIO share of its accumulated update (the
paper's per-layer threshold), and adds four remedies for what sparse, delayed updates do
to momentum SGD (§3 of the paper):

- **momentum correction**: each rank keeps its own momentum u ← μ·u + g and accumulates
  the velocity v ← v + u (instead of the gradient); the top-k entries of |v| are sent and
  zeroed in v. The ranks' sum of sent values / N is then applied as plain SGD
  (w ← w − lr·out): the hook takes over the SGD optimizer's momentum μ and sets the
  optimizer's own to 0 (`take_momentum`), so momentum is not applied twice.
- **momentum factor masking**: the sent entries are zeroed in u as well, so a stale
  momentum does not keep pushing an entry that was just applied.
- **local gradient clipping**: each rank clips its gradient, before accumulating it, to the
  run's clip threshold × N^(-1/2) (N ranks): accumulated gradients would otherwise escape
  a clipping applied after the reduction. The engine then clips nothing after the hook.
- **sparsity warm-up**: over the first `warmup` steps the share sent falls exponentially,
  25%, 6.25%, 1.5625%, ... (sparsity 75%, 93.75%, 98.4375%, ...), one stage per equal
  part of the warm-up, until the next stage would reach RATIO; then RATIO.

Every tensor is sparsified, as the paper's Algorithm 1 does layer by layer (its own top
k of its entries); `global-topk` selects over the whole bucket instead (the k largest of
all its entries, as Shi et al.'s gTop-k, ICDCS 2019, does over the model), which sends
the same number of entries but lets the layers with the largest accumulated updates take
more of them. The option `dense-vectors` follows the authors' code instead (their
github.com/synxlin/deep-gradient-compression compresses only tensors of more than one
dimension): biases and norm weights are then all-reduced whole and their momentum
applied after the average. The sparse entries travel as an all-gather of k int32 indices
and k fp32 values per rank, k the sum over tensors of ⌈share · entries⌉ (with
`global-topk`, ⌈share · the bucket's entries⌉).

Written here because torch ships no DGC hook. Its state is training state: the velocity
(the residual of `ErrorFeedback`), the momentum and the step count per bucket, saved in
checkpoints (`DGCState.saved`). Limits: one norm per bucket for the clipping (the paper's
norm is over the whole local gradient: the same when the stage's gradients fit one 25 MiB
bucket); no Nesterov momentum; weight decay stays in the optimizer, applied to the weights
densely (the authors add it to the gradient before compressing); the top-k is exact (the
authors estimate the threshold from a sample).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from plait.compression import Compression, DGCOptions
from plait.parallel.error_feedback import ErrorFeedback, finished

__all__ = ["DGCState", "dgc_hook", "dgc_share", "take_momentum"]

_WARMUP_FACTOR = 0.25  # the paper's 75%, 93.75%, ... sparsity: a quarter per stage


def dgc_share(ratio: float, warmup_steps: int, step: int) -> float:
    """The share of entries DGC sends at `step` (0 = the first): the warm-up's 0.25^(e+1)
    in stage e of the stages needed before 0.25^(e+1) would reach `ratio`, then `ratio`."""
    stages = 0
    while _WARMUP_FACTOR ** (stages + 1) > ratio:
        stages += 1
    if step >= warmup_steps or stages == 0:
        return ratio
    return float(_WARMUP_FACTOR ** (step * stages // warmup_steps + 1))


@dataclass
class DGCState(ErrorFeedback):
    """`ErrorFeedback` (the velocity is its residual) with DGC's momentum, the remedies,
    each bucket's step count, and the momentum μ and clip threshold taken from the run."""

    options: DGCOptions = field(default_factory=DGCOptions)
    momentum: float = 0.0
    clip: float | None = None
    momenta: dict[int, torch.Tensor] = field(default_factory=dict)
    steps: dict[int, int] = field(default_factory=dict)
    _layouts: dict[int, _Layout] = field(default_factory=dict)

    def saved(
        self, sizes: Mapping[int, int], device: torch.device, *, for_load: bool
    ) -> dict[str, torch.Tensor]:
        out = super().saved(sizes, device, for_load=for_load)
        for index, n in sizes.items():
            u = self.momenta.get(index)
            out[f"momentum.{index}"] = (
                u if u is not None and not for_load else torch.zeros(n, device=device)
            )
            out[f"step.{index}"] = torch.tensor([0 if for_load else self.steps.get(index, 0)])
        return out

    def restore(self, saved: Mapping[str, torch.Tensor]) -> None:
        super().restore({k: v for k, v in saved.items() if "." not in k})
        for key, value in saved.items():
            kind, _, index = key.partition(".")
            if kind == "momentum":
                self.momenta[int(index)] = value.clone()
            elif kind == "step":
                self.steps[int(index)] = int(value.item())

    def layout(self, bucket: Any) -> _Layout:
        """Where the bucket's tensors lie in its flat buffer, and which are sent sparse."""
        index = bucket.index()
        if index not in self._layouts:
            segments, dense, offset = [], [], 0
            for g in bucket.gradients():
                if g.dim() > 1 or not self.options.dense_vectors:
                    segments.append((offset, g.numel()))
                else:
                    dense.append(torch.arange(offset, offset + g.numel()))
                offset += g.numel()
            device = bucket.buffer().device
            sparse = [torch.arange(a, a + n) for a, n in segments]
            empty = torch.empty(0, dtype=torch.long)
            self._layouts[index] = _Layout(
                segments,
                torch.cat([empty, *sparse]).to(device),
                torch.cat([empty, *dense]).to(device),
            )
        return self._layouts[index]


@dataclass(frozen=True)
class _Layout:
    segments: list[tuple[int, int]]  # (offset, entries) of each tensor sent sparse
    sparse: torch.Tensor  # their flat positions
    dense: torch.Tensor  # the positions of the tensors all-reduced whole


def dgc_hook(state: DGCState, bucket: Any) -> torch.futures.Future[torch.Tensor]:
    """One bucket's DGC step (see the module docstring); its future yields the update that
    SGD without momentum applies."""
    index, world = bucket.index(), dist.get_world_size(state.process_group)
    grad = bucket.buffer().reshape(-1).float()
    threshold = state.options.clip if state.options.clip is not None else state.clip
    if state.options.clipping and threshold is not None:
        limit = threshold / math.sqrt(world)
        grad = grad * min(1.0, limit / (float(grad.norm()) + 1e-6))  # torch's clip rule
    layout = state.layout(bucket)
    velocity = state.residuals.setdefault(index, torch.zeros_like(grad))
    momentum = state.momenta.setdefault(index, torch.zeros_like(grad))
    out = torch.zeros_like(grad)
    if layout.dense.numel():
        out[layout.dense] = _dense(state, grad[layout.dense], layout.dense, momentum)
    if layout.segments:
        where = layout.sparse
        if state.options.correction:
            momentum[where] = momentum[where] * state.momentum + grad[where]
            velocity[where] += momentum[where]
        else:
            velocity[where] += grad[where]
        out += _sparse(state, index, layout, velocity, momentum) / world
    state.steps[index] = state.steps.get(index, 0) + 1
    return finished(bucket, out)


def _dense(
    state: DGCState, grad: torch.Tensor, where: torch.Tensor, momentum: torch.Tensor
) -> torch.Tensor:
    """The average of the tensors sent whole, momentum applied after it."""
    state.bytes_sent += grad.numel() * grad.element_size()
    dist.all_reduce(grad, group=state.process_group)
    grad /= dist.get_world_size(state.process_group)
    if not state.options.correction:
        return grad
    momentum[where] = momentum[where] * state.momentum + grad
    return momentum[where]


def _sparse(
    state: DGCState, index: int, layout: _Layout, velocity: torch.Tensor, momentum: torch.Tensor
) -> torch.Tensor:
    """The ranks' sum of their top-k velocity entries, k chosen per tensor (the paper's
    per-layer threshold) or over the bucket (`global-topk`); the entries sent are zeroed
    in the velocity (and momentum)."""
    segments, where = layout.segments, layout.sparse
    share = dgc_share(float(state.value or 1.0), state.options.warmup_steps,
                      state.steps.get(index, 0))  # fmt: skip
    if state.options.global_topk:  # one selection over the bucket's sparse entries
        k = min(where.numel(), max(1, math.ceil(share * where.numel())))
        chosen = where[velocity[where].abs().topk(k, sorted=False).indices]
    else:
        picked = []
        for offset, n in segments:
            k = min(n, max(1, math.ceil(share * n)))
            top = velocity[offset : offset + n].abs().topk(k, sorted=False).indices
            picked.append(top + offset)
        chosen = torch.cat(picked)
    values = velocity[chosen].clone()
    velocity[chosen] = 0.0
    if state.options.correction and state.options.masking:
        momentum[chosen] = 0.0
    total = torch.zeros_like(velocity)
    for i, x in zip(
        state._gather_same(chosen.to(torch.int32)), state._gather_same(values), strict=True
    ):
        total.index_add_(0, i.long(), x)
    return total


def take_momentum(
    state: DGCState, optimizers: Iterable[torch.optim.Optimizer], grad_clip: float | None
) -> None:
    """Move SGD's momentum into `state` (momentum correction) and note the run's clip
    threshold for the local clipping; the optimizers then step without momentum."""
    state.clip = grad_clip
    if not state.options.correction:
        return
    groups = [g for o in optimizers for g in o.param_groups]
    if any(not isinstance(o, torch.optim.SGD) and not _wraps_sgd(o) for o in optimizers):
        raise ValueError(_why(state, "needs the sgd optimizer"))
    if any(g.get("nesterov") for g in groups):
        raise ValueError(_why(state, "follows plain momentum, not Nesterov's"))
    momenta = {float(g["momentum"]) for g in groups}
    if len(momenta) > 1:
        raise ValueError(_why(state, f"needs one SGD momentum, not {sorted(momenta)}"))
    state.momentum = momenta.pop() if momenta else 0.0
    for g in groups:
        g["momentum"] = 0.0


def _wraps_sgd(optimizer: Any) -> bool:
    """ZeRO-1's ZeroRedundancyOptimizer around SGD."""
    return isinstance(getattr(optimizer, "optim", None), torch.optim.SGD)


def _why(state: DGCState, what: str) -> str:
    c = Compression("dgc", state.value, state.options)
    off = Compression("dgc", state.value, dataclasses.replace(state.options, correction=False))
    return (
        f"compress={c}: DGC's momentum correction {what}; use optimizer sgd with momentum, "
        f"or turn the correction off: compress={off}"
    )
