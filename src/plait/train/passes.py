"""The model transforms of `parallelize` as ordered passes, each with its own refusals.

A pass says when it acts (`active`), what it cannot do under a request (`refuse`: one line
naming the values and the fix, or None) and how it changes this rank's stages (`apply`).
`parallelize` asks every pass to refuse before it touches the model, then applies the
active ones in `PASSES` order, torchtitan's: experts and tensor parallelism shard the
blocks, context parallelism turns their attention into a ring, recomputation wraps them,
compile compiles the wrapped blocks; the replicas start alike; FSDP (ZeRO-2/3) or the
bucketed reducer (with its compression hook) becomes the gradient sync; the optimizers
(ZeRO-1 partitions them) and offload come last. A plan whose replicas are pipelines of
their own (HetPipe, WSP) runs the same passes on this rank's pipeline as a plan of its own
(`plait.train.placement`), and three passes of its own join the pipelines: they start
alike, their gradients meet weighted by their shares (synchronous), or WSP's waves carry
their updates. A new transform (FP8, another sharding) is
one more pass in this list, with its refusals beside its apply step; `plait capabilities`
prints the combinations they refuse (`plait.train.capabilities`).

The plan's own checks (`ParallelPlan.__post_init__`) stay where files and flags are read:
they refuse before any worker starts, and the simulator shares them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from plait.config import ParallelPlan
from plait.mesh import Meshes
from plait.parallel import (
    FSDPGradSync,
    GradReducer,
    apply_fsdp,
    apply_tensor_parallel,
    expert_grad_scale,
    expert_params,
    shard_experts,
)
from plait.parallel.compress import hook_for
from plait.parallel.hetero import BlockBuckets, PipelineGroups, ShareReducer
from plait.parallel.replicas import with_replicas
from plait.runtime.sync import GradSync
from plait.schedule import Schedule
from plait.train.compile import apply_compile, compile_refusal
from plait.train.context import apply_context_parallel, cp_refusal
from plait.train.offload import apply_offload
from plait.train.recompute import apply_recompute
from plait.train.wsp import WaveExchange

__all__ = ["PASSES", "Build", "Pass", "Request", "apply_passes", "refusals"]

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


@dataclass(frozen=True)
class Request:
    """What `parallelize` is asked for, known before the model is touched."""

    plan: ParallelPlan
    compile: bool = False
    mesh_given: bool = False  # the caller built the mesh (no expert view can be added)
    # a plan whose replicas are pipelines of their own (HetPipe, WSP): `plan` is then this
    # rank's pipeline as a plan of its own (dp = 1), and `whole` the plan of all of them
    whole: ParallelPlan | None = None


@dataclass
class Build:
    """One rank's engine while the passes build it."""

    request: Request
    meshes: Meshes
    schedule: Schedule
    stages: dict[int, nn.Module]
    optimizer_factory: OptimizerFactory
    num_blocks: int
    timeout_s: float | None
    grad_clip: float | None
    grad_sync: GradSync | None = None
    optimizers: dict[int, torch.optim.Optimizer] = field(default_factory=dict)
    # pipelines of their own: where they meet (`plait.parallel.hetero`), and WSP's waves
    groups: PipelineGroups | None = None
    buckets: BlockBuckets | None = None
    waves: WaveExchange | None = None

    @property
    def plan(self) -> ParallelPlan:
        return self.request.plan


@dataclass(frozen=True)
class Pass:
    """One transform: `name` (as `plait capabilities` prints it), when it acts, what it
    refuses, and its apply step over a `Build`."""

    name: str
    active: Callable[[Request], bool]
    apply: Callable[[Build], None]
    refuse: Callable[[Request], str | None] = lambda _r: None


def _experts_refusal(r: Request) -> str | None:
    if r.mesh_given and r.plan.ep > 1:
        return (
            f"ep={r.plan.ep} with a mesh given: the expert view of the ranks is built with "
            "it; pass mesh=None"
        )
    return None


def _shard_experts(b: Build) -> None:
    ep_group = b.meshes.ep_group()
    tp_group = b.meshes.main.get_group("tp") if b.plan.tp > 1 else None
    if ep_group is None and tp_group is None:
        return
    for stage in b.stages.values():  # same seed everywhere: each rank keeps its own experts
        shard_experts(stage, ep_group, tp_group=tp_group)


def _tensor_parallel(b: Build) -> None:
    for stage in b.stages.values():
        apply_tensor_parallel(
            stage, b.meshes.main["tp"], sequence_parallel=b.plan.sequence_parallel
        )


def _context_parallel(b: Build) -> None:
    group = b.meshes.cp_group()
    assert group is not None  # cp > 1 made the cp axis of the mesh
    apply_context_parallel(b.stages, group)


def _cp_refusal(r: Request) -> str | None:
    return cp_refusal(r.plan, compile=r.compile, mesh_given=r.mesh_given)


def _recompute_active(r: Request) -> bool:
    return r.plan.recompute != "none" or r.plan.recompute_stages is not None


def _recompute(b: Build) -> None:
    # a replicated schedule (Chimera) runs each part on two stages: both take the part's mode
    for stage, module in b.stages.items():
        apply_recompute(module, b.plan.recompute_of(b.schedule.parts[stage]))


def _compile(b: Build) -> None:
    for stage in b.stages.values():
        apply_compile(stage)


def _same_start(b: Build) -> None:
    """Every dp replica starts from dp rank 0's weights (and buffers); expert weights from
    their replica group's first rank (the ranks of an ep group hold different ones)."""
    if b.meshes.grad_dp().size() == 1:
        return
    group, experts = b.meshes.grad_dp().get_group(), b.meshes.expert_dp_group()
    for stage in b.stages.values():
        own = {id(p) for p in expert_params(stage)} if b.meshes.expert is not None else set()
        for t in [*stage.parameters(), *stage.buffers()]:
            local = t.to_local() if hasattr(t, "to_local") else t
            g = experts if id(t) in own else group
            dist.broadcast(local.data, src=dist.get_global_rank(g, 0), group=g)


def _pipelines_start_alike(b: Build) -> None:
    """Pipelines of their own start from pipeline 0's weights: each block group (the ranks
    holding that block, one per pipeline) broadcasts from its lowest rank."""
    assert b.groups is not None  # `parallelize` places such a plan's pipelines
    b.buckets = BlockBuckets(b.groups, b.stages)
    for index, (group, holders, _) in enumerate(b.buckets.buckets):
        flat = b.buckets.flat(index)
        dist.broadcast(flat, src=min(holders), group=group)
        b.buckets.copy_in(index, flat)


def _share_reducer(b: Build) -> None:
    """Synchronous pipelines of their own: gradients reduced per block group, weighted by
    each pipeline's share of the batch, so a step equals one process on the whole batch."""
    assert b.groups is not None and b.buckets is not None
    b.grad_sync = ShareReducer(b.buckets, b.groups.layout.batch_shares()[b.groups.pipeline])


def _waves(b: Build) -> None:
    """WSP: no gradient reduction; each pipeline steps its own optimizer and the wave
    exchange adds the others' updates D waves late (`plait.train.wsp`)."""
    whole = b.request.whole
    assert whole is not None and whole.wsp_staleness is not None and b.buckets is not None
    b.waves = WaveExchange(b.buckets, staleness=int(whole.wsp_staleness),
                           wave=whole.wsp_wave, at_most=whole.wsp_at_most)  # fmt: skip


def _own_pipelines(r: Request) -> bool:
    return r.whole is not None


def _synchronous_pipelines(r: Request) -> bool:
    return r.whole is not None and r.whole.wsp_staleness is None


def _wsp(r: Request) -> bool:
    return r.whole is not None and r.whole.wsp_staleness is not None


def _fsdp(b: Build) -> None:
    plan, meshes = b.plan, b.meshes
    reduce = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(plan.compress)
    edp = meshes.expert["edp"] if meshes.expert is not None else None
    sharded = {
        s: apply_fsdp(m, meshes.fsdp(), zero=plan.zero, reduce_dtype=reduce, expert_mesh=edp)
        for s, m in b.stages.items()
    }
    scaled = {s: expert_params(m) for s, m in b.stages.items()} if edp is not None else None
    b.grad_sync = FSDPGradSync(sharded, scaled=scaled, scale=expert_grad_scale(plan.ep, plan.tp))


def _reducer_active(r: Request) -> bool:
    # ep > 1 or tp > 1 with experts gives an expert view; `_reduce` finds out which
    return r.plan.zero < 2 and (r.plan.dp * r.plan.cp > 1 or r.plan.ep > 1 or r.plan.tp > 1)


def _reduce(b: Build) -> None:
    plan, meshes = b.plan, b.meshes
    if plan.dp * plan.cp == 1 and meshes.expert is None:
        return
    group = meshes.grad_dp().get_group()
    hook, state = hook_for(plan.compress, group) or (None, None)
    # expert gradients: averaged over the ranks holding the same experts, then × tp/ep
    # (their replica sum / dp; see plait.parallel.experts)
    experts = {p: meshes.expert_dp_group() for m in b.stages.values() for p in expert_params(m)}
    b.grad_sync = GradReducer(
        {s: list(m.parameters()) for s, m in b.stages.items()},
        group,
        param_groups=experts if meshes.expert is not None else None,
        group_scale=expert_grad_scale(plan.ep, plan.tp),
        timeout_s=b.timeout_s,
        hook=hook,
        hook_state=state,
    )


def _replicas(b: Build) -> None:
    b.grad_sync = with_replicas(b.grad_sync, b.schedule, b.stages, b.meshes.main)


def _zero1_refusal(r: Request) -> str | None:
    if r.plan.zero == 1 and r.plan.dp > 1 and r.plan.tp > 1:
        return (
            "zero=1 with tp > 1 is not supported (torch's ZeroRedundancyOptimizer takes plain "
            "tensors): use zero=2 or zero=3, which shard optimizer state too, or tp=1"
        )
    return None


def _optimizers(b: Build) -> None:
    for s, m in b.stages.items():
        b.optimizers[s] = _optimizer(b, [p for p in m.parameters() if p.requires_grad],
                                     expert_params(m))  # fmt: skip


def _optimizer(b: Build, params: list[nn.Parameter], experts: list[nn.Parameter]) -> Any:
    """One stage's optimizer; with ZeRO-1 partitioned over dp (experts over the ranks
    holding the same ones)."""
    plan, factory, meshes = b.plan, b.optimizer_factory, b.meshes
    if plan.zero != 1 or plan.dp == 1:
        return factory(params)
    from plait.parallel.expert_zero import ExpertZero, partitioned

    dp_group = meshes.main.get_group("dp")
    if meshes.expert is None or not experts:
        return partitioned(factory(params), dp_group)
    ids = {id(p) for p in experts}
    rest, mine = [p for p in params if id(p) not in ids], [p for p in params if id(p) in ids]
    return ExpertZero([partitioned(factory(rest), dp_group),
                       partitioned(factory(mine), meshes.expert_dp_group())])  # fmt: skip


def _offload(b: Build) -> None:
    apply_offload(b.stages, b.optimizers, activations=b.plan.offload_activations,
                  optimizer=b.plan.offload_optimizer, num_blocks=b.num_blocks)  # fmt: skip


def _dgc(b: Build) -> None:
    """Under DGC the hook takes SGD's momentum (momentum correction) and, with its local
    clipping, the clip threshold: nothing is clipped after the reduction then."""
    from plait.parallel.dgc import DGCState, take_momentum

    state = getattr(b.grad_sync, "hook_state", None)
    if not isinstance(state, DGCState):
        return
    take_momentum(state, b.optimizers.values(), b.grad_clip)
    if state.options.clipping:
        b.grad_clip = None


PASSES: tuple[Pass, ...] = (
    Pass("experts", lambda r: r.plan.ep > 1 or r.plan.tp > 1, _shard_experts, _experts_refusal),
    Pass("tensor parallel", lambda r: r.plan.tp > 1, _tensor_parallel),
    Pass("context parallel", lambda r: r.plan.cp > 1, _context_parallel, _cp_refusal),
    Pass("recompute", _recompute_active, _recompute),
    Pass("compile", lambda r: r.compile, _compile, lambda r: compile_refusal(ep=r.plan.ep)),
    Pass("same start", lambda r: True, _same_start),
    Pass("pipelines start alike", _own_pipelines, _pipelines_start_alike),
    Pass("fsdp", lambda r: r.plan.zero >= 2, _fsdp),
    Pass("reducer", _reducer_active, _reduce),
    Pass("share reducer", _synchronous_pipelines, _share_reducer),
    Pass("replicas", lambda r: True, _replicas),
    Pass("optimizer", lambda r: True, _optimizers, _zero1_refusal),
    Pass("waves", _wsp, _waves),
    Pass(
        "offload",
        lambda r: r.plan.offload_activations != "none" or r.plan.offload_optimizer,
        _offload,
    ),
    Pass("dgc", lambda r: r.plan.compress.startswith("dgc"), _dgc),
)


def refusals(request: Request, passes: Iterable[Pass] = PASSES) -> list[str]:
    """What the active passes refuse under `request` (empty: it can be built)."""
    return [f"{p.name}: {why}" for p in passes if p.active(request)
            for why in [p.refuse(request)] if why is not None]  # fmt: skip


def apply_passes(build: Build, passes: Iterable[Pass] = PASSES) -> None:
    """Refuse (every pass first, all reasons in one error), then apply, in order."""
    passes = tuple(passes)
    refused = refusals(build.request, passes)
    if refused:
        raise ValueError("; ".join(refused))
    for p in passes:
        if p.active(build.request):
            p.apply(build)
