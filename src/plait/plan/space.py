"""The space of layouts the planner searches, and the model description it searches for."""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from itertools import product

from plait.compression import parse_compression
from plait.cost import (
    BlockCost,
    Collective,
    Layout,
    MoEShape,
    moe_block_costs,
    transformer_block_costs,
)
from plait.layout import Layout as RankLayout
from plait.schedule import KINDS, kind_names, schedule_kind
from plait.sim import SimPlan

__all__ = [
    "ModelSpec",
    "SearchSpace",
    "candidates",
    "degrees",
    "expert_degrees",
    "gpt_spec",
    "hybrid_axes",
    "moe_spec",
    "scaled_spec",
]

# (micro-batch size, layout) -> the blocks of one rank; `Layout` names the only degrees
# they may depend on, which `ModelSpec` caches them by
BlockCosts = Callable[[int, Layout], Sequence[BlockCost]]


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """What the planner needs of a model: its block costs for a micro-batch size on one
    rank of a layout (its tensor-parallel degree, sequence parallelism and expert-parallel
    degree); the head count that tp must divide; its experts per MoE layer (0: none, ep
    stays 1)."""

    name: str
    num_blocks: int
    seq_len: int
    num_heads: int
    num_experts: int = 0
    costs: BlockCosts = field(compare=False, repr=False)
    # costs of the backward split in two passes (BI, BW), when they differ from the full
    # backward's (measured blocks: on some devices the two passes cost more than one)
    split_costs: BlockCosts | None = field(default=None, compare=False, repr=False)
    _cache: dict[tuple[int, int, bool, int, bool], tuple[BlockCost, ...]] = field(
        default_factory=dict, compare=False, repr=False
    )

    def blocks(
        self, micro_batch_size: int, layout: Layout, *, split: bool = False
    ) -> tuple[BlockCost, ...]:
        """The blocks of one rank of `layout`, cached by what changes them: the micro-batch
        size, the layout's degrees (`Layout`) and whether the backward is split."""
        split = split and self.split_costs is not None
        key = (micro_batch_size, layout.tp, layout.sequence_parallel, layout.ep, split)
        if key not in self._cache:
            source = self.split_costs if split and self.split_costs else self.costs
            self._cache[key] = tuple(source(micro_batch_size, layout))
        return self._cache[key]

    def blocks_for(self, plan: SimPlan) -> tuple[BlockCost, ...]:
        """The blocks as `plan` runs them (split backward for zero-bubble schedules)."""
        split = schedule_kind(plan.schedule).split_backward
        return self.blocks(plan.micro_batch_size, plan, split=split)


def gpt_spec(
    *,
    num_layers: int,
    hidden: int,
    num_heads: int,
    seq_len: int,
    vocab_size: int,
    ffn_hidden: int = 0,
    dtype: str = "bf16",
    dropout: float = 0.0,
) -> ModelSpec:
    """A GPT described analytically (any size; nothing is built), with dropout
    probability `dropout` (plait's GPT default: none)."""

    def costs(b: int, layout: Layout) -> list[BlockCost]:
        return transformer_block_costs(
            num_layers=num_layers,
            hidden=hidden,
            num_heads=num_heads,
            seq_len=seq_len,
            vocab_size=vocab_size,
            micro_batch_size=b,
            ffn_hidden=ffn_hidden,
            dtype=dtype,
            layout=layout,
            dropout=dropout,
        )

    name = f"gpt-{num_layers}x{hidden}"
    return ModelSpec(
        name=name, num_blocks=num_layers + 2, seq_len=seq_len, num_heads=num_heads, costs=costs
    )


def moe_spec(
    *,
    num_layers: int,
    hidden: int,
    num_heads: int,
    seq_len: int,
    vocab_size: int,
    moe: MoEShape,
    ffn_hidden: int = 0,
    dtype: str = "bf16",
) -> ModelSpec:
    """A MoE-GPT described analytically (`plait.cost.moe_block_costs`); each plan's ep
    picks how many experts a rank holds. No sequence parallelism."""

    def costs(b: int, layout: Layout) -> list[BlockCost]:
        return moe_block_costs(
            num_layers=num_layers, hidden=hidden, num_heads=num_heads, seq_len=seq_len,
            vocab_size=vocab_size, moe=moe, micro_batch_size=b, ffn_hidden=ffn_hidden,
            dtype=dtype, layout=layout,
        )  # fmt: skip

    name = f"moe-gpt-{num_layers}x{hidden}-e{moe.num_experts}k{moe.top_k}"
    return ModelSpec(
        name=name, num_blocks=num_layers + 2, seq_len=seq_len, num_heads=num_heads,
        num_experts=moe.num_experts, costs=costs,
    )  # fmt: skip


def scaled_spec(
    name: str,
    measured: Mapping[int, Sequence[BlockCost]],
    *,
    seq_len: int,
    num_heads: int,
    tp_blocks: Collection[int] = (),
    measured_split: Mapping[int, Sequence[BlockCost]] | None = None,
) -> ModelSpec:
    """A model known from its blocks measured at one or more micro-batch sizes (tp = 1).

    Each cost is taken as linear in the micro-batch size through the measured points,
    a + c·b, so that the fixed cost of a call (which dominates small micro-batches on a
    CPU) is kept; with one point it is proportional. Blocks in `tp_blocks` shard under
    tensor parallelism as a Megatron layer does: work, parameters and saved activations
    divide by tp, and each pass adds two all-reduces of the block's output; the others
    are computed whole on every tensor-parallel rank. `measured_split` holds the same
    blocks with the backward timed as two passes (for zero-bubble schedules)."""

    def builder(source: Mapping[int, Sequence[BlockCost]]) -> BlockCosts:
        points = sorted(source.items())
        if not points:
            raise ValueError("no measured blocks: profile the model at >= 1 micro-batch size")
        if len({len(blocks) for _, blocks in points}) != 1:
            raise ValueError("the measured profiles disagree on the number of blocks")
        sharded = frozenset(tp_blocks)

        def costs(b: int, layout: Layout) -> list[BlockCost]:
            # measured blocks have no experts and keep whole sequences
            return [
                _at([(size, blocks[i]) for size, blocks in points], b,
                    layout.tp if i in sharded else 1)
                for i in range(len(points[0][1]))
            ]  # fmt: skip

        return costs

    count = len(next(iter(measured.values()), ()))
    return ModelSpec(
        name=name, num_blocks=count, seq_len=seq_len, num_heads=num_heads,
        costs=builder(measured),
        split_costs=builder(measured_split) if measured_split else None,
    )  # fmt: skip


_LINEAR = (
    "forward_flops", "backward_input_flops", "backward_weight_flops", "activation_bytes",
    "saved_bytes",
)  # fmt: skip


def _at(points: list[tuple[int, BlockCost]], b: int, tp: int) -> BlockCost:
    """A block, measured at the sizes of `points`, at micro-batch size `b` on one of `tp`
    ranks."""
    (b1, c1), (b2, c2) = points[0], points[-1]

    def value(field_name: str) -> float:
        v1, v2 = getattr(c1, field_name), getattr(c2, field_name)
        if b2 == b1:
            return float(v1) * b / b1
        slope = (v2 - v1) / (b2 - b1)
        return max(float(v1) + slope * (b - b1), float(v1) * min(1.0, b / b1) * 0.5)

    at = {k: value(k) for k in _LINEAR}
    recompute = c1.saved_bytes_recompute
    kept = None if recompute is None else recompute * b / b1
    comm: tuple[Collective, ...] = ()
    if tp > 1:
        comm = (Collective(kind="all_reduce", num_bytes=at["activation_bytes"], axis="tp"),) * 2
    return replace(
        c1,
        forward_flops=at["forward_flops"] / tp,
        backward_input_flops=at["backward_input_flops"] / tp,
        backward_weight_flops=at["backward_weight_flops"] / tp,
        activation_bytes=at["activation_bytes"],
        saved_bytes=at["saved_bytes"] / tp,
        saved_bytes_recompute=kept,
        num_params=c1.num_params // tp,
        forward_comm=comm,
        backward_comm=comm,
    )


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
    # hybrid sharding (HSDP) where a data-parallel group spans nodes: FSDP inside a node,
    # all-reduce across (`hybrid_axes`)
    hybrid: bool = True

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
        if not self.micro_batch_sizes or min(self.micro_batch_sizes) < 1:
            raise ValueError(f"micro_batch_sizes={self.micro_batch_sizes} must be >= 1")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def expert_degrees(dp: int, num_experts: int, tp: int = 1) -> list[int]:
    """The expert-parallel degrees of a layout with `dp` data-parallel ranks of `tp`
    tensor-parallel ones: every ep dividing both dp × tp (ep borrows its ranks) and the
    experts (each rank holds E/ep); [1] for a model without experts."""
    if num_experts < 1:
        return [1]
    return [ep for ep in _divisors(dp * tp) if num_experts % ep == 0]


def degrees(
    num_devices: int, *, devices_per_node: int, num_heads: int, num_blocks: int
) -> list[tuple[int, int, int]]:
    """Every (dp, tp, pp) with dp·tp·pp = `num_devices`, tensor parallelism inside a node
    (tp divides the devices of a node) and dividing the head count, pp <= blocks."""
    out = []
    for tp in _divisors(num_devices):
        if devices_per_node % tp or num_heads % tp:
            continue
        for pp in _divisors(num_devices // tp):
            if pp <= num_blocks:
                out.append((num_devices // (tp * pp), tp, pp))
    return out


def candidates(
    model: ModelSpec,
    space: SearchSpace,
    *,
    num_devices: int,
    devices_per_node: int,
    global_batch: int,
) -> Iterator[SimPlan]:
    """Every plan of the space for `num_devices` devices and `global_batch` samples."""
    for dp, tp, pp in degrees(
        num_devices,
        devices_per_node=devices_per_node,
        num_heads=model.num_heads,
        num_blocks=model.num_blocks,
    ):
        yield from _layouts(model, space, dp, tp, pp, global_batch)
        if space.hybrid:
            yield from _hybrid(model, space, dp, tp, pp, global_batch, devices_per_node)


def hybrid_axes(
    dp: int, tp: int, pp: int, rank_order: str, devices_per_node: int
) -> tuple[int, int] | None:
    """(dp_replicate, dp_shard) of the hybrid sharding that keeps each shard group inside
    a node: dp_shard = the data-parallel ranks a node holds (`plait.layout.Layout`), when
    the data-parallel group spans nodes and a node holds more than one of its ranks; else
    None (plain FSDP is then as local, or there is nothing to keep inside a node)."""
    group = RankLayout(pp=pp, dp_replicate=dp, tp=tp, rank_order=rank_order).ranks("dp", 0)
    shard = sum(1 for r in group if r < devices_per_node)
    if 1 < shard < dp and dp % shard == 0:
        return dp // shard, shard
    return None


def _hybrid(
    model: ModelSpec,
    space: SearchSpace,
    dp: int,
    tp: int,
    pp: int,
    global_batch: int,
    devices_per_node: int,
) -> Iterator[SimPlan]:
    """The hybrid-sharded plans of one (dp, tp, pp): ZeRO-2/3 on (dp_replicate, dp_shard)
    for each rank order, with plain experts-free layouts (HSDP refuses ep > 1)."""
    zeros = tuple(z for z in space.zero_stages if z >= 2)
    if not zeros or model.num_experts:
        return
    orders = space.rank_orders if pp > 1 else space.rank_orders[:1]
    for order in orders:
        axes = hybrid_axes(dp, tp, pp, order, devices_per_node)
        if axes is None:
            continue
        narrowed = replace(space, zero_stages=zeros, rank_orders=(order,))
        for plan in _layouts(model, narrowed, dp, tp, pp, global_batch):
            yield replace(plan, dp_replicate=axes[0], dp_shard=axes[1])


def _layouts(
    model: ModelSpec, space: SearchSpace, dp: int, tp: int, pp: int, global_batch: int
) -> Iterator[SimPlan]:
    """Every plan of one (dp, tp, pp): ep (for a model with experts) and the options."""
    for ep in expert_degrees(dp, model.num_experts, tp):
        sizes = [b for b in space.micro_batch_sizes if global_batch % (dp * b) == 0]
        options = product(
            sizes,
            _schedules(space, pp, model.num_blocks),
            space.recompute,
            space.zero_stages if dp > 1 else (0,),
            # MoE layers take whole sequences (plait.models.moe)
            space.sequence_parallel if tp > 1 and not model.num_experts else (False,),
            # the order of ranks matters only when both dp and pp split the devices
            space.rank_orders if dp > 1 and pp > 1 else space.rank_orders[:1],
            space.compress if dp > 1 else ("none",),
        )
        for b, (kind, chunks), recompute, zero, sp, order, compress in options:
            if KINDS[kind].unsupported(tp=tp, zero=zero, dtype=space.dtype) is not None:
                continue
            if zero >= 2 and compress not in ("none", "fp16", "bf16"):
                continue  # FSDP2's reduce-scatter takes no hook (plait.cost.compress)
            yield SimPlan(
                dp=dp,
                tp=tp,
                pp=pp,
                ep=ep,
                schedule=kind,
                microbatches=global_batch // (dp * b),
                micro_batch_size=b,
                chunks=chunks,
                recompute=recompute,  # type: ignore[arg-type]
                zero=zero,
                dtype=space.dtype,
                sequence_parallel=sp,
                optimizer=space.optimizer,  # type: ignore[arg-type]
                seq_len=model.seq_len,
                rank_order=order,
                compress=compress,
            )


def _schedules(space: SearchSpace, pp: int, num_blocks: int) -> list[tuple[str, int]]:
    if pp == 1:  # one stage: every schedule is plain gradient accumulation
        return [("1f1b", 1)]
    out = []
    for kind in space.schedules:
        if KINDS[kind].chunked:
            out += [(kind, v) for v in space.chunks if v >= 2 and pp * v <= num_blocks]
        else:
            out.append((kind, 1))
    return out
