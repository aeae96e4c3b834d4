"""One line that names a plan: its degrees, schedule, micro-batching and memory options."""

from __future__ import annotations

from plait.sim import SimPlan

__all__ = ["describe", "recompute"]


def describe(plan: SimPlan) -> str:
    """`plan` as the tables, explanations and benchmarks print it."""
    sched = plan.schedule + (f"x{plan.chunks}" if plan.chunks > 1 else "")
    sp = "+sp" if plan.sequence_parallel else ""
    order = "" if plan.rank_order == "tp-dp-pp" else f" order={plan.rank_order}"
    compress = "" if plan.compress == "none" else f" compress={plan.compress}"
    ep = f" ep={plan.ep}" if plan.ep > 1 else ""
    cp = f" cp={plan.cp}" if plan.cp > 1 else ""
    if plan.dp_replicate is not None or plan.dp_shard is not None:  # hybrid sharding
        ep += f" (replicate={plan.layout.dp_replicate} shard={plan.layout.dp_shard})"
    offload = [
        *(["activations"] if plan.offload_activations != "none" else []),
        *(["optimizer"] if plan.offload_optimizer else []),
    ]
    pp = str(plan.pp)
    if len(set(plan.depths)) > 1:  # pipelines of their own depths, their shares alike
        pp = "+".join(map(str, plan.depths))
    return (
        f"dp={plan.dp}{ep}{cp} tp={plan.tp}{sp} pp={pp} {sched} m={_shares(plan)} "
        f"b={plan.micro_batch_size} recompute={recompute(plan)} zero={plan.zero}{order}"
        f"{compress}"
        + (f" offload={'+'.join(offload)}" if offload else "")
        + (f" wsp={plan.wsp_staleness}" if plan.wsp_staleness is not None else "")
    )


def _shares(plan: SimPlan) -> str:
    """Micro-batches per replica: one count, or the two of unequal shares and their sum."""
    if len(set(plan.depths)) > 1:
        return "+".join(map(str, plan.shares))
    first, last, total = plan.shares[0], plan.shares[-1], plan.total_microbatches
    return f"{first}/{last} ({total} in all)" if total else str(first)


def recompute(plan: SimPlan) -> str:
    """The plan's recomputation: one mode, or each stage's, first to last."""
    return plan.recompute if plan.recompute_stages is None else ",".join(plan.recompute_stages)
