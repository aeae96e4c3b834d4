"""Expert parallelism: each rank of an ep group holds a slice of every MoE layer's experts,
and all-to-alls carry token copies to the rank holding their expert and the outputs back.

Why it is written here: torch has building blocks for tensor parallelism (DTensor) and
sharded data parallelism (FSDP2) but none for mixture-of-experts dispatch, and the
libraries that have one (DeepSpeed-MoE, Tutel) bring their own MoE layer and engine. The
pattern is GShard's (Lepikhin et al. 2020: dispatch, all-to-all, experts, all-to-all,
combine), also used by Switch Transformers (Fedus et al. 2021), DeepSpeed-MoE (Rajbhandari
et al. 2022) and Tutel (Hwang et al. 2023). Those pad every expert to its capacity so that
one equal-split all-to-all suffices; here the per-expert counts are exchanged first and
the tokens travel with variable splits (as in MegaBlocks' dropless MoE, Gale et al. 2022,
and torchtitan's expert parallelism), so dropless and capacity routing share one code
path and no padding crosses the wire. The collective is `all_to_all_single` in a small
autograd function whose backward is the same all-to-all with the splits swapped, so each
expert's input gradients travel back to the ranks that sent the tokens (`_AllToAll`:
torch's functional collective does the same at twice the cost per call on gloo).

Gradient semantics. Let `dp` be the number of ranks that see different data; ep borrows
its ranks from them (ep divides dp; the dp ranks form dp/ep ep groups). Each rank's loss
`loss_i` is a mean over its own micro-batch and the step minimises
`L = (1/dp) · Σ_i loss_i`.
- A replicated parameter (router, shared expert, attention, embeddings) receives
  `∂loss_i/∂θ` on rank i: average it over all dp ranks, as data parallelism does.
- An expert parameter on ep rank r receives, from its rank's backward alone,
  `Σ_{i in its ep group} ∂loss_i/∂w`: the reverse all-to-all has already brought every
  contribution of its group's tokens. The same expert lives on one rank of each of the
  dp/ep ep groups (its replicas: the ranks with the same ep rank). So its gradient must be
  SUMMED over those dp/ep replicas and divided by dp. A reducer that averages over its
  group (divides by the group size, as `GradReducer` does) reduces expert parameters over
  the replica group and then multiplies by `expert_grad_scale(ep) = 1/ep`. Averaging them
  over all dp ranks would mix different experts; summing again over the ep group would
  count each contribution ep times. Gradient accumulation changes nothing: every
  micro-batch's loss is divided by the number of micro-batches on every rank alike.

Every forward of a sharded layer is a collective: all ranks of an ep group must run it
together, the same number of times in the same order (training steps, evaluation and
generation alike; activation recomputation repeats it in backward, on every rank alike).
Limits: the router sees only its rank's tokens, so the capacity and the load-balancing
loss are per rank (as in GShard's per-group capacity); reading the exchanged counts
synchronises host and device once per layer forward; communication does not overlap the
expert computation; the local experts run one after another.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from plait.models.moe import Experts, MoEConfig, MoELayer

__all__ = [
    "ExpertBench",
    "ExpertExchange",
    "bench_expert_parallel",
    "check_expert_parallel",
    "check_expert_plan",
    "expert_grad_scale",
    "expert_param_names",
    "expert_params",
    "reduce_expert_grads",
    "shard_experts",
]


def check_expert_parallel(num_experts: int, ep: int) -> None:
    """Raise ValueError unless `num_experts` experts split evenly over `ep` ranks."""
    if ep < 1 or num_experts % ep:
        divisors = [d for d in range(1, num_experts + 1) if num_experts % d == 0]
        raise ValueError(
            f"num_experts={num_experts} cannot be split over ep={ep} ranks: use an ep that "
            f"divides it ({', '.join(map(str, divisors))}) or a multiple of ep experts"
        )


def check_expert_plan(*, ep: int, zero: int, compress: str, schedule: str) -> None:
    """Raise ValueError for what the runtime cannot yet combine with ep > 1 (nothing at ep=1).

    - ZeRO-1: torch's ZeroRedundancyOptimizer partitions every parameter over one
      data-parallel group and broadcasts the updates over it, which would mix the
      different experts of an ep group's ranks (ZeRO-2/3 shard experts over their
      replicas: `plait.parallel.sharding.apply_fsdp`);
    - gradient compression: a communication hook reduces over one group, while expert
      gradients are reduced over their replica group (`plait.parallel.data.GradReducer`).

    Zero-bubble schedules need nothing: the all-to-all's backward lies on the path from
    the outputs to the inputs, so it runs in the input half, and the ranks of an ep group
    (one pipeline rank) run the same program, so their collectives pair up in order.
    """
    if ep == 1:
        return
    if zero == 1:
        raise ValueError(
            f"zero=1 with ep={ep} is not supported yet: torch's ZeroRedundancyOptimizer "
            "partitions and broadcasts every parameter over all data-parallel ranks, whose "
            "experts differ; use zero=0, 2 or 3"
        )
    if compress != "none":
        raise ValueError(
            f"compress={compress!r} with ep={ep} is not supported yet: a compression hook "
            "reduces over one group, expert gradients over their replicas; use compress=none"
        )


class ExpertExchange:
    """The expert-parallel path between `MoELayer.dispatch` and `MoELayer.combine`.

    Called as `exchange(experts, grouped, counts)` with this rank's token copies sorted by
    global expert (`grouped` [copies, hidden], `counts` [num_experts]); returns the expert
    outputs in the same order, computed by the ranks that hold the experts."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.ep = dist.get_world_size(group)
        # when a list: the seconds this rank spends in each collective of the exchange,
        # forward and backward, appended in the order they end (`plait bench moe`
        # measures the all-to-all share of a step with it); None: nothing is timed
        self.timings: list[float] | None = None

    def __deepcopy__(self, memo: dict[int, object]) -> ExpertExchange:
        # a copied layer (a weight version of an asynchronous schedule) shares the group
        return self

    def __call__(self, experts: Experts, grouped: torch.Tensor, counts: list[int]) -> torch.Tensor:
        ep, local = self.ep, len(experts.local_experts)
        if len(counts) != ep * local:
            raise ValueError(f"{len(counts)} expert counts for ep={ep} × {local} local experts")
        dtype, device = grouped.dtype, grouped.device.type
        if torch.is_autocast_enabled(device):
            # the experts compute in the autocast dtype: the copies travel in it (half the
            # bytes of fp32 under bf16) and come back in it; the values are those of a
            # cast after the exchange, which only copies them
            grouped = grouped.to(torch.get_autocast_dtype(device))
        sent = torch.tensor(counts, dtype=torch.int64, device=grouped.device)
        recv = torch.empty_like(sent)
        start = time.perf_counter()
        dist.all_to_all_single(recv, sent, group=self.group)
        # recv[s, l]: copies that source rank s sends to this rank's local expert l; the
        # splits must be known on the host: the one host-device synchronisation
        recv_host = recv.view(ep, local).cpu()
        if self.timings is not None:
            self.timings.append(time.perf_counter() - start)
        send_splits = [sum(counts[r * local : (r + 1) * local]) for r in range(ep)]
        recv_splits = recv_host.sum(dim=1).tolist()
        # [received, hidden], by source rank, then local expert
        received = self._all_to_all(grouped, recv_splits, send_splits)
        order = _expert_major(recv.view(ep, local), sum(recv_splits))
        out = experts(received[order], recv_host.sum(dim=0).tolist())
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        # [copies, hidden], in this rank's dispatch order
        back = self._all_to_all(out[inverse], send_splits, recv_splits)
        return back.to(dtype)

    def _all_to_all(
        self, x: torch.Tensor, out_splits: list[int], in_splits: list[int]
    ) -> torch.Tensor:
        """The variable-split all-to-all; its backward: the same with the splits swapped."""
        return _AllToAll.apply(x, out_splits, in_splits, self.group, self.timings)  # type: ignore[no-untyped-call]


class _AllToAll(torch.autograd.Function):
    """`all_to_all_single` with variable splits, differentiable: the backward sends each
    row's gradient back to the rank the row came from. torch's functional collective
    (`_functional_collectives.all_to_all_single_autograd`) does the same, but each call
    took twice as long as the plain collective on gloo here (0.95 ms against 0.42-0.50 ms
    for 512 KiB over 2 ranks, the least time over the ranks, median of 35 calls). With
    `timings` a list, each call's seconds (forward and backward) are appended to it."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        out_splits: list[int],
        in_splits: list[int],
        group: dist.ProcessGroup,
        timings: list[float] | None,
    ) -> torch.Tensor:
        ctx.splits, ctx.group, ctx.timings = (out_splits, in_splits), group, timings
        return _exchange(x, out_splits, in_splits, group, timings)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        out_splits, in_splits = ctx.splits
        dx = _exchange(grad, in_splits, out_splits, ctx.group, ctx.timings)
        return dx, None, None, None, None


def _exchange(
    x: torch.Tensor,
    out_splits: list[int],
    in_splits: list[int],
    group: dist.ProcessGroup,
    timings: list[float] | None,
) -> torch.Tensor:
    x = x.contiguous()
    out = x.new_empty(sum(out_splits), *x.shape[1:])
    start = time.perf_counter()
    dist.all_to_all_single(out, x, out_splits, in_splits, group=group)
    if timings is not None:  # host seconds: the call returns when gloo's exchange is done
        timings.append(time.perf_counter() - start)
    return out


def _expert_major(recv: torch.Tensor, total: int) -> torch.Tensor:
    """The permutation that regroups `total` received rows from (source rank, local
    expert) order to (local expert, source rank) order, so that each local expert's tokens
    from all ranks are contiguous. `recv` [ep, local] holds the row counts of each chunk."""
    ep, local = recv.shape
    chunks = torch.arange(ep * local, device=recv.device)
    chunk = torch.repeat_interleave(chunks, recv.flatten(), output_size=total)  # [total]
    source, expert = chunk // local, chunk % local
    return torch.argsort(expert * ep + source, stable=True)


def _moe_layers(module: nn.Module) -> list[MoELayer]:
    return [m for m in module.modules() if isinstance(m, MoELayer)]


def shard_experts(module: nn.Module, ep_group: dist.ProcessGroup) -> list[MoELayer]:
    """Keep on this rank only its slice of the experts of every MoE layer in `module` (a
    `MoELayer` or a model holding some) and route the layer through the ep all-to-all.

    Rank r of the ep group keeps the contiguous experts `[r·E/ep, (r+1)·E/ep)`: the
    stacked weights become new parameters holding that slice (so an optimizer built
    afterwards sees only local experts). The router and the shared expert stay
    replicated. Call it on every rank of the group, after building the model from the
    same seed everywhere and before building the optimizer. Returns the sharded layers."""
    layers = _moe_layers(module)
    ep, rank = dist.get_world_size(ep_group), dist.get_rank(ep_group)
    for layer in layers:
        experts, num_experts = layer.experts, layer.router.num_experts
        check_expert_parallel(num_experts, ep)
        if len(experts.local_experts) != num_experts:
            raise ValueError(f"{type(layer).__name__} is already sharded: shard it once")
        if ep == 1:
            continue
        per_rank = num_experts // ep
        start = rank * per_rank
        for name in ("w1", "b1", "w2", "b2"):
            full: nn.Parameter = getattr(experts, name)
            part = full.detach()[start : start + per_rank].clone()
            setattr(experts, name, nn.Parameter(part, requires_grad=full.requires_grad))
        experts.local_experts = range(start, start + per_rank)
        layer.exchange = ExpertExchange(ep_group)
    return layers


def expert_params(model: nn.Module) -> list[nn.Parameter]:
    """The parameters of every `Experts` module in `model`: the ones whose gradients are
    reduced over their replica group rather than over all data-parallel ranks."""
    return [p for m in model.modules() if isinstance(m, Experts) for p in m.parameters()]


def expert_param_names(model: nn.Module) -> list[str]:
    """The names of `expert_params(model)` as its state dict has them, without the prefix
    activation recomputation's wrapper adds (as torch's `get_model_state_dict` gives them)."""
    ids = {id(p) for p in expert_params(model)}
    return [n.replace("_checkpoint_wrapped_module.", "")
            for n, p in model.named_parameters() if id(p) in ids]  # fmt: skip


def expert_grad_scale(ep: int) -> float:
    """The factor for expert gradients after averaging them over their replica group (the
    dp/ep ranks with the same ep rank): 1/ep, so that the result is the replica sum / dp."""
    if ep < 1:
        raise ValueError(f"ep={ep} must be >= 1")
    return 1.0 / ep


def reduce_expert_grads(
    params: list[nn.Parameter], *, replica_group: dist.ProcessGroup | None, dp: int
) -> None:
    """Sum the expert gradients over `replica_group` (None: a single replica, dp == ep)
    and divide by `dp`, in place: the reduction stated in this module's docstring."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    if replica_group is not None:
        dist.all_reduce(flat, group=replica_group)
    flat.div_(dp)
    for g, part in zip(grads, torch.split(flat, [g.numel() for g in grads]), strict=True):
        g.copy_(part.view_as(g))


@dataclass(frozen=True)
class ExpertBench:
    """Median seconds of one expert-parallel layer's forward and backward on this rank,
    with the token copies it received for its local experts per step (mean)."""

    ep: int
    tokens: int
    forward_s: float
    backward_s: float
    received_copies: float


def bench_expert_parallel(
    ep_group: dist.ProcessGroup,
    *,
    tokens: int,
    hidden: int,
    ffn: int,
    num_experts: int,
    top_k: int = 2,
    capacity_factor: float | None = 1.25,
    steps: int = 10,
    warmup: int = 2,
    device: torch.device | None = None,
) -> ExpertBench:
    """Time forward and backward of one MoE layer sharded over `ep_group`, on `tokens`
    random tokens per rank. Call it on every rank of the group at once."""
    if tokens < 1 or steps < 1 or warmup < 0:
        raise ValueError(f"tokens={tokens}, steps={steps} must be >= 1, warmup={warmup} >= 0")
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = MoEConfig(hidden=hidden, num_heads=1, ffn_hidden=ffn, num_experts=num_experts,
                    top_k=top_k, capacity_factor=capacity_factor)  # fmt: skip
    torch.manual_seed(0)  # the same layer on every rank, as a model is built
    layer = MoELayer(cfg).to(device)
    shard_experts(layer, ep_group)
    received: list[int] = []
    layer.experts.register_forward_hook(lambda _m, args, _o: received.append(args[0].shape[0]))
    torch.manual_seed(1 + dist.get_rank())  # but each rank its own tokens
    x = torch.randn(tokens, hidden, device=device, requires_grad=True)
    fwd, bwd = [], []
    for step in range(warmup + steps):
        t0 = _now(device)
        y, aux = layer(x)
        t1 = _now(device)
        (y.square().mean() + aux).backward()
        t2 = _now(device)
        if step >= warmup:
            fwd.append(t1 - t0)
            bwd.append(t2 - t1)
    return ExpertBench(
        ep=dist.get_world_size(ep_group),
        tokens=tokens,
        forward_s=statistics.median(fwd),
        backward_s=statistics.median(bwd),
        received_copies=statistics.fmean(received[warmup:]),
    )


def _now(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()
