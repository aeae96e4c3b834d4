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

Tensor parallelism (torchtitan's layout with etp=1): the experts' weights are not
sharded by tp. The tp ranks of a replica hold the same micro-batch; each routes all of its
tokens (so capacity, dropping and the router losses are the unsplit layer's), then
dispatches only its own slice of them (`TokenSplit`) and all-gathers the layer's output
over tp. ep borrows its ranks from dp × tp (`plait.layout`), so an ep group may hold tp
ranks of one replica, different replicas, or both.

Gradient semantics. Let `dp` be the number of replicas that see different data, each of
`tp` ranks; ep divides dp × tp and the dp × tp ranks form dp·tp/ep ep groups. Replica
i's loss `loss_i` is a mean over its own micro-batch and the step minimises
`L = (1/dp) · Σ_i loss_i`.
- A replicated parameter (router, attention, embeddings, the tp shards of the shared
  expert) receives `∂loss_i/∂θ` on every rank of replica i: average it over all dp
  replicas, as data parallelism does. (The router's gradient is whole on each tp rank:
  `TokenSplit.scatter`'s backward gathers the gate gradients of every slice.)
- An expert parameter on ep rank r receives, from its rank's backward alone, the
  contributions of the token slices of every rank of its ep group: the reverse
  all-to-all has already brought them. The same expert lives on one rank of each of the
  dp·tp/ep ep groups (its replicas: the ranks with the same ep rank), and the slices of all
  of them together are every replica's whole micro-batch. So its gradient must be SUMMED
  over those dp·tp/ep replicas and divided by dp. A reducer that averages over its group
  (divides by the group size, as `GradReducer` does) reduces expert parameters over the
  replica group and then multiplies by `expert_grad_scale(ep, tp) = tp/ep`. Averaging
  them over all dp ranks would mix different experts; summing again over the ep group
  would count each contribution ep times. Gradient accumulation changes nothing: every
  micro-batch's loss is divided by the number of micro-batches on every rank alike.

Every forward of a sharded layer is a collective: all ranks of an ep group (and of a tp
group) must run it together, the same number of times in the same order (training steps,
evaluation and generation alike; activation recomputation repeats it in backward, on
every rank alike). Zero-bubble schedules need nothing more: the all-to-all's and
`TokenSplit`'s backward lie on the path from the outputs to the inputs, so they run in the
input half, and the ranks of an ep group (one pipeline rank) run the same program. ZeRO-1
partitions the experts over their replicas (`plait.parallel.expert_zero`); gradient
compression compresses only the data-parallel reduction, the experts' is uncompressed
(`plait.parallel.data.GradReducer`), except under ZeRO-2/3, whose fp16/bf16 reduce
dtype applies to every gradient (`plait.parallel.sharding.apply_fsdp`).

Limits: the router sees only its replica's tokens, so the capacity and the load-balancing
loss are per replica micro-batch (as in GShard's per-group capacity); under tp every tp
rank routes the whole micro-batch (the router's FLOPs are not split); reading the
exchanged counts synchronises host and device once per layer forward; communication does
not overlap the expert computation; the local experts run one after another.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from plait.models.moe import Experts, MoELayer

__all__ = [
    "ExpertExchange",
    "TokenSplit",
    "check_expert_parallel",
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


class TokenSplit:
    """The tensor-parallel ranks of a replica split a MoE layer's tokens: rank t takes the
    t-th of `torch.tensor_split`'s tp contiguous row blocks (`rows`). Megatron-LM's
    scatter to and gather from the sequence-parallel region (Korthikanti et al. 2022) in
    their non-reducing form: every tp rank holds the same tokens and receives the same
    upstream gradients, so `scatter`'s backward all-gathers the rows' gradients (each
    rank computed its own rows') and `gather`'s backward keeps this rank's rows."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.tp, self.rank = dist.get_world_size(group), dist.get_rank(group)

    def __deepcopy__(self, memo: dict[int, object]) -> TokenSplit:
        return self  # a copied layer (a weight version) shares the group

    def rows(self, num_tokens: int) -> tuple[int, int]:
        """This rank's rows [start, stop) of `num_tokens`, as `torch.tensor_split` cuts them."""
        lengths = self._lengths(num_tokens)
        start = sum(lengths[: self.rank])
        return start, start + lengths[self.rank]

    def _lengths(self, num_tokens: int) -> list[int]:
        """Every rank's row count: the first num_tokens mod tp ranks take one more."""
        base, extra = divmod(num_tokens, self.tp)
        return [base + (r < extra) for r in range(self.tp)]

    def scatter(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = _Scatter.apply(x, self)  # type: ignore[no-untyped-call]
        return out

    def gather(self, x: torch.Tensor, num_tokens: int) -> torch.Tensor:
        out: torch.Tensor = _Gather.apply(x, self, num_tokens)  # type: ignore[no-untyped-call]
        return out

    def all_rows(self, part: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """Every rank's rows `part` [its rows, ...] in rank order: [num_tokens, ...]. The
        blocks differ by at most one row: the shorter ones padded by a row for one
        all-gather, which then drops the pads."""
        lengths = self._lengths(num_tokens)
        size = lengths[0]  # the largest
        if part.shape[0] < size:
            part = torch.cat([part, part.new_zeros(1, *part.shape[1:])])
        out = part.new_empty(self.tp * size, *part.shape[1:])
        dist.all_gather_into_tensor(out, part, group=self.group)
        if lengths[-1] == size:
            return out
        return torch.cat([out[r * size : r * size + n] for r, n in enumerate(lengths)])


class _Scatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, split: TokenSplit) -> torch.Tensor:
        ctx.split, ctx.num_tokens = split, x.shape[0]
        start, stop = split.rows(x.shape[0])
        return x[start:stop].clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return ctx.split.all_rows(grad.contiguous(), ctx.num_tokens), None


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, part: torch.Tensor, split: TokenSplit, num_tokens: int) -> torch.Tensor:
        ctx.split, ctx.num_tokens = split, num_tokens
        return split.all_rows(part.contiguous(), num_tokens)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        start, stop = ctx.split.rows(ctx.num_tokens)
        return grad[start:stop].contiguous(), None, None


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


def shard_experts(
    module: nn.Module,
    ep_group: dist.ProcessGroup | None,
    *,
    tp_group: dist.ProcessGroup | None = None,
) -> list[MoELayer]:
    """Keep on this rank only its slice of the experts of every MoE layer in `module` (a
    `MoELayer` or a model holding some) and route the layer through the ep all-to-all
    (`ep_group` None: no exchange); with a `tp_group` of several ranks, make the layer
    dispatch only this rank's slice of the tokens (`TokenSplit`).

    Rank r of the ep group keeps the contiguous experts `[r·E/ep, (r+1)·E/ep)`: the
    stacked weights become new parameters holding that slice (so an optimizer built
    afterwards sees only local experts). The router and the shared expert stay
    replicated. Call it on every rank of the group, after building the model from the
    same seed everywhere and before building the optimizer. Returns the sharded layers."""
    layers = _moe_layers(module)
    ep = dist.get_world_size(ep_group) if ep_group is not None else 1
    rank = dist.get_rank(ep_group) if ep_group is not None else 0
    split = TokenSplit(tp_group) if tp_group is not None and tp_group.size() > 1 else None
    for layer in layers:
        experts, num_experts = layer.experts, layer.router.num_experts
        check_expert_parallel(num_experts, ep)
        if len(experts.local_experts) != num_experts or layer.tokens is not None:
            raise ValueError(f"{type(layer).__name__} is already sharded: shard it once")
        layer.tokens = split
        if ep_group is None or ep == 1:
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


def expert_grad_scale(ep: int, tp: int = 1) -> float:
    """The factor for expert gradients after averaging them over their replica group (the
    dp·tp/ep ranks with the same ep rank): tp/ep, so that the result is the replica sum / dp."""
    if ep < 1 or tp < 1:
        raise ValueError(f"ep={ep} and tp={tp} must be >= 1")
    return tp / ep


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
