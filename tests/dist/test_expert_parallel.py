"""Expert parallelism against one process: every rank builds the same MoE layer (or
MoE-GPT) from one seed and gets its own tokens; the reference computes, in one process and
with all experts, the loss `mean over ranks of each rank's mean loss` and its gradients.

The router sees only its rank's tokens under expert parallelism, so the capacity (and the
load-balancing loss) count one rank's tokens: the reference routes each rank's tokens on
their own, then applies every expert densely to every token, masked by that routing."""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from plait.models import MoEConfig, MoEGPT
from plait.models.moe import MoELayer
from plait.parallel.clip import clip_grad_norm
from plait.profile.experts import bench_expert_parallel
from plait.parallel.experts import (
    expert_grad_scale,
    expert_params,
    TokenSplit,
    reduce_expert_grads,
    shard_experts,
)
from tests.dist.harness import run_world

pytestmark = pytest.mark.dist

TOL = {"rtol": 1e-5, "atol": 1e-5}
AUX, Z = 0.3, 0.05


@dataclass(frozen=True)
class Case:
    ep: int
    num_experts: int
    top_k: int
    capacity_factor: float | None  # None: dropless
    shared: bool = False


def _groups(rank: int, world: int, ep: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup | None]:
    """(this rank's ep group, its replica group or None): ep groups are consecutive ranks,
    a replica group the ranks with the same ep rank. Every rank creates every group."""
    ep_group = replica = None
    for g in range(world // ep):
        ranks = list(range(g * ep, (g + 1) * ep))
        pg = dist.new_group(ranks)
        ep_group = pg if rank in ranks else ep_group
    if world > ep:
        for r in range(ep):
            ranks = list(range(r, world, ep))
            pg = dist.new_group(ranks)
            replica = pg if rank in ranks else replica
    assert ep_group is not None
    return ep_group, replica


def _dense(layer: MoELayer, x: torch.Tensor, cfg: MoEConfig) -> tuple[torch.Tensor, ...]:
    """(output [T, h], weighted router loss, dropped copies) of `layer` on one rank's
    tokens `x` [T, h], with every expert applied to every token from the stacked weights."""
    t_count, e_count, k = x.shape[0], cfg.num_experts, cfg.top_k
    logits = x @ layer.router.gate.weight.t()
    probs = logits.softmax(dim=-1)
    top_p, top_e = probs.topk(k, dim=-1)
    gate = top_p / top_p.sum(dim=-1, keepdim=True) if k > 1 else top_p
    cf = cfg.capacity_factor
    cap = math.ceil(cf * t_count * k / e_count) if cf else t_count * k
    fill, kept = [0] * e_count, torch.zeros(t_count, k)
    for c in range(k):  # every first choice queues before any second choice
        for t in range(t_count):
            e = int(top_e[t, c])
            if fill[e] < cap:
                fill[e], kept[t, c] = fill[e] + 1, 1.0
    weight = sum(gate[:, c, None] * kept[:, c, None] * F.one_hot(top_e[:, c], e_count)
                 for c in range(k))  # fmt: skip
    ex = layer.experts
    every = torch.stack(
        [F.gelu(x @ ex.w1[e] + ex.b1[e]) @ ex.w2[e] + ex.b2[e] for e in range(e_count)]
    )  # [E, T, h]
    y = torch.einsum("te,eth->th", weight, every)
    if layer.shared is not None:
        y = y + layer.shared(x)
    f = F.one_hot(top_e, e_count).sum(dim=(0, 1)).float() / (t_count * k)
    aux = e_count * (f * probs.mean(dim=0)).sum()
    z = logits.logsumexp(dim=-1).square().mean()
    return y, AUX * aux + Z * z, torch.tensor(t_count * k - int(kept.sum()))


def _check_grads(
    sharded: torch.nn.Module,
    reference: torch.nn.Module,
    *,
    world: int,
    ep: int,
    replica: dist.ProcessGroup | None,
) -> None:
    """Replicated grads averaged over all ranks, expert grads summed over replicas / dp
    (and, the other way round, averaged over replicas × 1/ep): the reference's (slice)."""
    ref = dict(reference.named_parameters())
    experts = {id(p) for p in expert_params(sharded)}
    local = {id(p): p.grad.clone() for p in expert_params(sharded)}  # type: ignore[union-attr]
    reduce_expert_grads(expert_params(sharded), replica_group=replica, dp=world)
    for name, p in sharded.named_parameters():
        assert p.grad is not None, name
        want = ref[name].grad
        assert want is not None, name
        if id(p) in experts:
            owner = next(m for m in sharded.modules() if any(q is p for q in m.parameters(False)))
            span = owner.local_experts
            assert p.shape[0] == len(span) == want.shape[0] // ep, name
            torch.testing.assert_close(p.grad, want[span.start : span.stop], **TOL, msg=name)
            averaged = local[id(p)]
            if replica is not None:
                dist.all_reduce(averaged, group=replica)
                averaged /= dist.get_world_size(replica)
            averaged *= expert_grad_scale(ep)
            torch.testing.assert_close(averaged, want[span.start : span.stop], **TOL, msg=name)
        else:
            g = p.grad.clone()
            dist.all_reduce(g)
            torch.testing.assert_close(g / world, want, **TOL, msg=name)


def _layer_case(rank: int, world: int, case: Case) -> None:
    cfg = MoEConfig(hidden=8, num_heads=2, ffn_hidden=12, num_experts=case.num_experts,
                    top_k=case.top_k, capacity_factor=case.capacity_factor,
                    shared_expert=case.shared, aux_loss_coef=AUX, z_loss_coef=Z)  # fmt: skip
    torch.manual_seed(0)
    layer = MoELayer(cfg)
    with torch.no_grad():  # biases away from zero, and a router that is not uniform
        for p in layer.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    reference = copy.deepcopy(layer)
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(12, 8, generator=gen) for _ in range(world)]  # each rank's tokens
    probes = [torch.randn(12, 8, generator=gen) for _ in range(world)]

    # the reference: one process, all experts, each rank's tokens routed on their own
    ref_xs = [x.clone().requires_grad_() for x in xs]
    ref_ys, ref_losses, dropped = zip(*(_dense(reference, x, cfg) for x in ref_xs), strict=True)
    ref_rank_losses = [(y * p).sum(dim=-1).mean() + r for y, p, r in zip(ref_ys, probes, ref_losses, strict=True)]  # fmt: skip
    torch.stack(ref_rank_losses).mean().backward()
    if case.capacity_factor:
        assert sum(int(d) for d in dropped) > 0, "the case should drop token copies"
    else:
        assert sum(int(d) for d in dropped) == 0

    ep_group, replica = _groups(rank, world, case.ep)
    assert len(shard_experts(layer, ep_group)) == 1
    x = xs[rank].clone().view(2, 6, 8).requires_grad_()
    y, layer_loss = layer(x)
    ((y.reshape(-1, 8) * probes[rank]).sum(dim=-1).mean() + layer_loss).backward()
    torch.testing.assert_close(y.reshape(-1, 8), ref_ys[rank], **TOL)
    torch.testing.assert_close(layer_loss, ref_losses[rank], **TOL)
    # rank j's input gradient is that of loss_j, the reference's that of mean_j loss_j
    torch.testing.assert_close(x.grad.reshape(-1, 8) / world, ref_xs[rank].grad, **TOL)  # type: ignore[union-attr]
    _check_grads(layer, reference, world=world, ep=case.ep, replica=replica)


def _model_case(rank: int, world: int, ep: int) -> None:
    cfg = MoEConfig(vocab_size=32, seq_len=8, num_layers=2, hidden=16, num_heads=2,
                    num_experts=4, top_k=2, capacity_factor=1.0, moe_every=1,
                    shared_expert=True, aux_loss_coef=AUX, z_loss_coef=Z)  # fmt: skip
    torch.manual_seed(0)
    model = MoEGPT(cfg)
    reference = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(2)
    ids = [torch.randint(0, 32, (2, 8), generator=gen) for _ in range(world)]
    targets = [torch.randint(0, 32, (2, 8), generator=gen) for _ in range(world)]

    ref_losses = [MoEGPT.loss(reference(i), t) for i, t in zip(ids, targets, strict=True)]
    torch.stack(ref_losses).mean().backward()

    ep_group, replica = _groups(rank, world, ep)
    assert len(shard_experts(model, ep_group)) == cfg.num_layers
    loss = MoEGPT.loss(model(ids[rank]), targets[rank])
    loss.backward()
    torch.testing.assert_close(loss, ref_losses[rank], **TOL)
    _check_grads(model, reference, world=world, ep=ep, replica=replica)

    # clipping: the expert grads' squares summed over the ep group, the others' not
    experts = {id(p) for p in expert_params(model)}
    for p in model.parameters():  # the data-parallel average, in place this time
        if id(p) not in experts:
            dist.all_reduce(p.grad)  # type: ignore[arg-type]
            p.grad /= world  # type: ignore[operator]
    ref_grads = {n: p.grad for n, p in reference.named_parameters()}
    ref_norm = torch.linalg.vector_norm(torch.cat([g.flatten() for g in ref_grads.values()]))  # type: ignore[union-attr]
    max_norm = float(ref_norm) / 2
    total = clip_grad_norm(list(model.parameters()), max_norm, pp_group=None,
                           ep_group=ep_group, ep_params=expert_params(model))  # fmt: skip
    torch.testing.assert_close(total, ref_norm, **TOL)
    coef = max_norm / (float(ref_norm) + 1e-6)  # torch's clip_grad_norm_ epsilon
    experts_1 = model.layers[1].ffn.experts
    span = experts_1.local_experts
    want = ref_grads["layers.1.ffn.experts.w1"][span.start : span.stop] * coef  # type: ignore[index]
    torch.testing.assert_close(experts_1.w1.grad, want, **TOL)


def _bad_input(rank: int, world: int) -> None:
    group = dist.new_group(list(range(world)))
    cfg = MoEConfig(hidden=8, num_heads=2, num_experts=3, top_k=1)
    with pytest.raises(ValueError, match=r"num_experts=3 cannot be split over ep=2"):
        shard_experts(MoELayer(cfg), group)
    layer = MoELayer(MoEConfig(hidden=8, num_heads=2, num_experts=4))
    shard_experts(layer, group)
    with pytest.raises(ValueError, match="already sharded"):
        shard_experts(layer, group)
    twin = copy.deepcopy(layer)  # as a weight version of an asynchronous schedule is made
    assert twin.exchange is layer.exchange and twin.experts.w1 is not layer.experts.w1


def _bench(rank: int, world: int) -> None:
    group = dist.new_group(list(range(world)))
    tokens, top_k, steps, warmup = 16, 2, 2, 1
    result = bench_expert_parallel(group, tokens=tokens, hidden=8, ffn=16, num_experts=4,
                                   top_k=top_k, capacity_factor=None, steps=steps,
                                   warmup=warmup)  # fmt: skip
    assert result.ep == world and result.tokens == tokens
    assert result.forward_s > 0 and result.backward_s > 0
    # dropless: every rank's token copies arrive somewhere, each step
    total = torch.tensor(result.received_copies)
    dist.all_reduce(total)
    assert total.item() == pytest.approx(world * tokens * top_k)


def _world_two(rank: int, world: int) -> None:
    torch.use_deterministic_algorithms(True)
    for case in [
        Case(ep=2, num_experts=4, top_k=1, capacity_factor=0.5),
        Case(ep=2, num_experts=4, top_k=2, capacity_factor=None, shared=True),
        Case(ep=2, num_experts=8, top_k=2, capacity_factor=0.8),
    ]:
        _layer_case(rank, world, case)
    _model_case(rank, world, ep=2)
    _bad_input(rank, world)
    _bench(rank, world)


def _world_four(rank: int, world: int) -> None:
    torch.use_deterministic_algorithms(True)
    for case in [
        Case(ep=4, num_experts=8, top_k=2, capacity_factor=0.8, shared=True),
        Case(ep=4, num_experts=4, top_k=1, capacity_factor=None),
        Case(ep=2, num_experts=8, top_k=1, capacity_factor=0.6),  # ep × dp = 2 × 2
        Case(ep=2, num_experts=4, top_k=2, capacity_factor=None),
    ]:
        _layer_case(rank, world, case)
    _model_case(rank, world, ep=2)
    _token_split_case(rank, world)


def _token_split_case(rank: int, world: int) -> None:
    """The tp ranks' token split, on an even and an uneven number of rows: each rank
    scatters its `torch.tensor_split` block, the gather gives every rank all rows in
    order, and the gradients come back whole to every rank."""
    split = TokenSplit(dist.group.WORLD)  # type: ignore[arg-type]
    for num_tokens in (8, 5):  # 4 ranks: 2 rows each; 2, 1, 1 and 1
        x = torch.arange(num_tokens * 3, dtype=torch.float32).view(num_tokens, 3)
        x.requires_grad_(True)
        weight = torch.linspace(-1.0, 1.0, num_tokens * 3).view(num_tokens, 3)
        part = split.scatter(x)
        torch.testing.assert_close(part, torch.tensor_split(x, world)[rank])
        full = split.gather(2 * part, num_tokens)
        torch.testing.assert_close(full, 2 * x)
        (full * weight).sum().backward()
        assert x.grad is not None
        torch.testing.assert_close(x.grad, 2 * weight)


def test_expert_parallel_over_two_ranks(tmp_path: Path) -> None:
    run_world(tmp_path, 2, _world_two)


def test_expert_parallel_over_four_ranks_with_two_ep_groups(tmp_path: Path) -> None:
    run_world(tmp_path, 4, _world_four)
