"""The space of layouts the planner searches (the model descriptions: `plait.plan.specs`)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from itertools import product

from plait.compression import parse_compression
from plait.layout import Layout as RankLayout
from plait.plan.axes import Rule, divisors, factorisations
from plait.plan.specs import ModelSpec, gpt_spec, moe_spec, scaled_spec
from plait.schedule import KINDS, kind_names
from plait.sim import SimPlan

__all__ = [
    "DP_AXES",
    "PLANNED_AXES",
    "ModelSpec",
    "SearchSpace",
    "axis_rules",
    "candidates",
    "context_degrees",
    "degrees",
    "expert_degrees",
    "gpt_spec",
    "hybrid_axes",
    "moe_spec",
    "scaled_spec",
]


@dataclass(frozen=True, kw_only=True)
class SearchSpace:
    """Which options the search tries.

    `schedules` defaults to every synchronous kind of the registry; asynchronous kinds
    (whose updates use stale weights, which changes what training converges to) are
    searched only with `allow_staleness`, and then all of them by default. `compress`
    lists the gradient compressions tried for data-parallel plans (lossy ones change what
    training converges to, so only "none" unless asked).
    """

    schedules: tuple[str, ...] = ()
    allow_staleness: bool = False
    chunks: tuple[int, ...] = (2, 4)
    recompute: tuple[str, ...] = ("none", "selective", "full")
    zero_stages: tuple[int, ...] = (0, 1, 2, 3)
    micro_batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    sequence_parallel: tuple[bool, ...] = (False, True)
    dtype: str = "bf16"
    optimizer: str = "adam"
    # global rank order, innermost axis first; "tp-pp-dp" keeps each pipeline on
    # neighbouring devices (one node kind), "tp-dp-pp" spreads it over the nodes
    rank_orders: tuple[str, ...] = ("tp-dp-pp",)
    compress: tuple[str, ...] = ("none",)
    # context-parallel degrees tried for a model that supports them (plait's GPT), where
    # the sequence divides into 2·cp chunks, with synchronous schedules only; and only for
    # sequences of `cp_min_seq_len` tokens or more: below that a sample's activations are
    # what micro-batch size, recomputation and tp already shrink (Megatron-LM's guidance
    # is CP from 8K tokens), and each cp degree would multiply the candidates to estimate
    cp: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    cp_min_seq_len: int = 8192
    # hybrid sharding (HSDP) where a data-parallel group spans nodes: FSDP inside a node,
    # all-reduce across (`hybrid_axes`)
    hybrid: bool = True
    # replicas with unequal shares where the batch does not divide equally among them
    uneven_shares: bool = True
    # activations or optimizer state in host memory, where a plan fits only so and could
    # win, or nothing fits without (`plait.plan.offload`)
    offload: bool = True

    def __post_init__(self) -> None:
        if not self.compress:
            raise ValueError("compress=(): give at least 'none'")
        object.__setattr__(
            self, "compress", tuple(str(parse_compression(c)) for c in self.compress)
        )
        if not self.schedules:
            default = kind_names(synchronous=None if self.allow_staleness else True, searched=True)
            object.__setattr__(self, "schedules", default)
        bad = [s for s in self.schedules if s not in KINDS]
        if bad:
            raise ValueError(f"schedules={self.schedules}: choose from {list(KINDS)}")
        stale = [s for s in self.schedules if not KINDS[s].synchronous]
        if stale and not self.allow_staleness:
            raise ValueError(
                f"schedules {stale} update on stale weights, which changes what training "
                "converges to: set allow_staleness=True (--allow-staleness) to search them"
            )
        if 1 not in self.cp or min(self.cp) < 1:
            raise ValueError(f"cp={self.cp} must hold 1 and only degrees >= 1")
        # ascending, as the factorisations try them (`context_degrees` keeps this order)
        object.__setattr__(self, "cp", tuple(sorted(set(self.cp))))
        if not self.micro_batch_sizes or min(self.micro_batch_sizes) < 1:
            raise ValueError(f"micro_batch_sizes={self.micro_batch_sizes} must be >= 1")


# the axes the planner factorises the devices over, in the order the candidates come in
# (the first outermost; the search breaks ties by it): `dp` stands for the data-parallel
# view until hybrid sharding splits it over `DP_AXES`; `ep` is no factor (it borrows ranks)
PLANNED_AXES: tuple[str, ...] = ("cp", "tp", "pp", "dp")
DP_AXES: tuple[str, ...] = ("dp_replicate", "dp_shard")


def axis_rules(model: ModelSpec, space: SearchSpace, devices_per_node: int) -> dict[str, Rule]:
    """The degrees each axis of `PLANNED_AXES` admits (one without a rule takes what the
    others leave): where a new axis says what it needs."""
    return {
        "cp": _cp_rule(model, space),
        "tp": _tp_rule(devices_per_node, model.num_heads),
        "pp": _pp_rule(model.num_blocks),
    }


def _cp_rule(model: ModelSpec, space: SearchSpace) -> Rule:
    """The degrees of `space.cp` whose 2·cp zigzag chunks divide the sequence, for a model
    that supports context parallelism (no experts) and a sequence of at least
    `space.cp_min_seq_len` tokens; else 1."""
    if not model.context_parallel or model.num_experts or model.seq_len < space.cp_min_seq_len:
        return lambda cp, _: cp == 1
    # cp = 1 splits nothing, so it needs no even sequence (an odd one still trains)
    return lambda cp, _: cp == 1 or (cp in space.cp and model.seq_len % (2 * cp) == 0)


def _tp_rule(devices_per_node: int, num_heads: int) -> Rule:
    """Tensor parallelism inside a node (its all-reduces need the fast links), splitting
    the heads evenly."""
    return lambda tp, _: devices_per_node % tp == 0 and num_heads % tp == 0


def _pp_rule(num_blocks: int) -> Rule:
    """A block a stage at least."""
    return lambda pp, _: pp <= num_blocks


def _shard_rule(dp: int, tp: int, pp: int, rank_order: str, devices_per_node: int) -> Rule:
    """HSDP keeps each shard group inside a node: dp_shard is the data-parallel ranks a
    node holds (`plait.layout.Layout`), where the data-parallel group spans nodes and a
    node holds more than one of its ranks (plain FSDP is else as local, or there is
    nothing to keep inside a node)."""
    group = RankLayout(pp=pp, dp_replicate=dp, tp=tp, rank_order=rank_order).ranks("dp", 0)
    share = sum(1 for r in group if r < devices_per_node)
    return lambda shard, _: 1 < shard < dp and shard == share


def _takes_uneven(model: ModelSpec, space: SearchSpace, factors: Mapping[str, int]) -> bool:
    """Replicas with shares of their own run as pipelines of their own (`plait.pipelines`):
    whole, unsharded replicas, so no tp, no cp (plait.train.context) and no experts."""
    if not space.uneven_shares or model.num_experts:
        return False
    return factors["dp"] >= 2 and factors["tp"] == 1 and factors["cp"] == 1


def _takes_hybrid(model: ModelSpec, space: SearchSpace, factors: Mapping[str, int]) -> bool:
    """HSDP runs ZeRO-2/3 without experts (it refuses ep > 1) nor cp (plait.train.context)."""
    if not space.hybrid or model.num_experts or all(z < 2 for z in space.zero_stages):
        return False
    return factors["cp"] == 1


def expert_degrees(dp: int, num_experts: int, tp: int = 1) -> list[int]:
    """The expert-parallel degrees of a layout with `dp` data-parallel ranks of `tp`
    tensor-parallel ones: every ep dividing both dp × tp (ep borrows its ranks) and the
    experts (each rank holds E/ep); [1] for a model without experts."""
    if num_experts < 1:
        return [1]
    return [ep for ep in divisors(dp * tp) if num_experts % ep == 0]


def degrees(
    num_devices: int, *, devices_per_node: int, num_heads: int, num_blocks: int
) -> list[tuple[int, int, int]]:
    """Every (dp, tp, pp) with dp·tp·pp = `num_devices`, tensor parallelism inside a node
    (tp divides the devices of a node) and dividing the head count, pp <= blocks."""
    rules = {"tp": _tp_rule(devices_per_node, num_heads), "pp": _pp_rule(num_blocks)}
    return [
        (f["dp"], f["tp"], f["pp"]) for f in factorisations(num_devices, ("tp", "pp", "dp"), rules)
    ]


def candidates(
    model: ModelSpec,
    space: SearchSpace,
    *,
    num_devices: int,
    devices_per_node: int,
    global_batch: int,
) -> Iterator[SimPlan]:
    """Every plan of the space for `num_devices` devices and `global_batch` samples: for
    each factorisation of the devices over `PLANNED_AXES`, its plans of equal shares, then
    of unequal shares, then hybrid-sharded, where the factorisation takes them."""
    rules = axis_rules(model, space, devices_per_node)
    for f in factorisations(num_devices, PLANNED_AXES, rules):
        dp, tp, pp, cp = f["dp"], f["tp"], f["pp"], f["cp"]
        yield from _layouts(model, space, dp, tp, pp, global_batch, cp)
        if _takes_uneven(model, space, f):
            yield from _uneven(model, space, dp, pp, global_batch)
        if _takes_hybrid(model, space, f):
            yield from _hybrid(model, space, f, global_batch, devices_per_node)


def context_degrees(model: ModelSpec, space: SearchSpace, num_devices: int) -> list[int]:
    """The cp degrees searched on `num_devices` devices (`_cp_rule`), in the order of
    `space.cp`."""
    rule = _cp_rule(model, space)
    return [c for c in space.cp if num_devices % c == 0 and rule(c, {})]


def hybrid_axes(
    dp: int, tp: int, pp: int, rank_order: str, devices_per_node: int
) -> tuple[int, int] | None:
    """(dp_replicate, dp_shard) of the hybrid sharding that keeps each shard group inside
    a node (`_shard_rule`), or None where there is none."""
    rules = {"dp_shard": _shard_rule(dp, tp, pp, rank_order, devices_per_node)}
    split = next(factorisations(dp, DP_AXES, rules), None)
    return None if split is None else (split["dp_replicate"], split["dp_shard"])


def _hybrid(
    model: ModelSpec,
    space: SearchSpace,
    factors: Mapping[str, int],
    global_batch: int,
    devices_per_node: int,
) -> Iterator[SimPlan]:
    """The hybrid-sharded plans of one factorisation: ZeRO-2/3 on each split of dp over
    `DP_AXES` that a rank order admits, for each rank order."""
    dp, tp, pp = factors["dp"], factors["tp"], factors["pp"]
    zeros = tuple(z for z in space.zero_stages if z >= 2)
    orders = space.rank_orders if pp > 1 else space.rank_orders[:1]
    for order in orders:
        rules = {"dp_shard": _shard_rule(dp, tp, pp, order, devices_per_node)}
        for split in factorisations(dp, DP_AXES, rules):
            narrowed = replace(space, zero_stages=zeros, rank_orders=(order,))
            axes = (split["dp_replicate"], split["dp_shard"])
            yield from _layouts(model, narrowed, dp, tp, pp, global_batch, axes=axes)


def _layouts(
    model: ModelSpec, space: SearchSpace, dp: int, tp: int, pp: int, global_batch: int, cp: int = 1,
    *, axes: tuple[int, int] | None = None,
) -> Iterator[SimPlan]:  # fmt: skip
    """Every plan of one (dp, tp, pp) and cp: ep (for a model with experts) and the
    options (under cp > 1: synchronous schedules, no compression, as training runs it);
    with `axes`, hybrid-sharded over (dp_replicate, dp_shard)."""
    replicate, shard = axes if axes is not None else (None, None)
    for ep in expert_degrees(dp, model.num_experts, tp):
        sizes = [b for b in space.micro_batch_sizes if global_batch % (dp * b) == 0]
        options = product(
            sizes,
            _schedules(space, pp, model.num_blocks),
            space.recompute,
            space.zero_stages if dp > 1 else (0,),
            # MoE layers take whole sequences (plait.models.moe); sequence parallelism
            # splits each cp rank's s/cp tokens over tp
            space.sequence_parallel
            if tp > 1 and not model.num_experts and (model.seq_len // cp) % tp == 0
            else (False,),
            # the order of ranks matters only when both dp and pp split the devices
            space.rank_orders if dp > 1 and pp > 1 else space.rank_orders[:1],
            space.compress if dp > 1 and cp == 1 else ("none",),
        )
        checked: dict[tuple[object, ...], SimPlan] = {}  # by all but the batch shape
        for b, (kind, chunks), recompute, zero, sp, order, compress in options:
            if KINDS[kind].unsupported(tp=tp, zero=zero, dtype=space.dtype) is not None:
                continue
            if cp > 1 and not KINDS[kind].synchronous:
                continue
            if zero >= 2 and compress not in ("none", "fp16", "bf16"):
                continue  # FSDP2's reduce-scatter takes no hook (plait.cost.compress)
            m = global_batch // (dp * b)
            key = (kind, chunks, recompute, zero, sp, order, compress)
            if key in checked:
                yield _reshaped(checked[key], microbatches=m, micro_batch_size=b)
                continue
            checked[key] = SimPlan(
                dp=dp,
                dp_replicate=replicate,
                dp_shard=shard,
                tp=tp,
                cp=cp,
                pp=pp,
                ep=ep,
                schedule=kind,
                chunks=chunks,
                recompute=recompute,  # type: ignore[arg-type]
                zero=zero,
                dtype=space.dtype,
                sequence_parallel=sp,
                optimizer=space.optimizer,  # type: ignore[arg-type]
                seq_len=model.seq_len,
                rank_order=order,
                compress=compress,
                microbatches=m,
                micro_batch_size=b,
            )
            yield checked[key]


def _reshaped(plan: SimPlan, *, microbatches: int, micro_batch_size: int) -> SimPlan:
    """`plan` with another batch shape (`microbatches` and `micro_batch_size`, both
    >= 1), without checking it again: a plan's checks do not read its batch shape beyond
    its being positive (`total_microbatches` is 0 here), and a large space has tens of
    thousands of candidates that differ from a checked one only so, whose checks took most
    of the time to enumerate them (`tests/unit/test_plan_space_axes.py` checks every
    candidate of several spaces against the checked constructor)."""
    out = object.__new__(SimPlan)
    out.__dict__.update(plan.__dict__)
    out.__dict__.update(microbatches=microbatches, micro_batch_size=micro_batch_size)
    return out


def _uneven(
    model: ModelSpec, space: SearchSpace, dp: int, pp: int, global_batch: int
) -> Iterator[SimPlan]:
    """The plans of one (dp, tp, pp) whose replicas take unequal shares of the batch, where
    the micro-batches do not divide equally among them: shares differing by one, as
    pipelines of their own (`plait.pipelines`), whose runtime takes whole, unsharded
    replicas of one stage a rank (zero=0, no compression; which degrees take them:
    `_takes_uneven`)."""
    sizes = [
        b for b in space.micro_batch_sizes
        if global_batch % b == 0 and global_batch % (dp * b) and global_batch // b >= dp
    ]  # fmt: skip
    kinds = [k for k, chunks in _schedules(space, pp, model.num_blocks)
             if chunks == 1 and not KINDS[k].replicated and KINDS[k].synchronous]  # fmt: skip
    for b, kind, recompute in product(sizes, kinds, space.recompute):
        total = global_batch // b
        yield SimPlan(
            dp=dp, pp=pp, schedule=kind, microbatches=-(-total // dp), micro_batch_size=b,
            total_microbatches=total, recompute=recompute,  # type: ignore[arg-type]
            dtype=space.dtype, optimizer=space.optimizer,  # type: ignore[arg-type]
            seq_len=model.seq_len, rank_order=space.rank_orders[0],
        )  # fmt: skip


def _schedules(space: SearchSpace, pp: int, num_blocks: int) -> list[tuple[str, int]]:
    if pp == 1:  # one stage: every schedule is plain gradient accumulation
        return [("1f1b", 1)]
    out = []
    for kind in space.schedules:
        entry = KINDS[kind]
        if entry.exact_chunks:  # ZB-V: exactly two stages per rank, whatever `chunks` lists
            if pp * entry.exact_chunks <= num_blocks:
                out.append((kind, entry.exact_chunks))
        elif entry.chunked:
            out += [(kind, v) for v in space.chunks if v >= 2 and pp * v <= num_blocks]
        else:
            out.append((kind, 1))
    return out
