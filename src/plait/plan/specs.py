"""The model descriptions the planner searches for: each block's costs by micro-batch size
and layout (`ModelSpec`), for plait's GPT, its MoE variant, and a model scaled from
measured blocks."""

from __future__ import annotations

import bisect
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace

from plait.cost import (
    BlockCost,
    Collective,
    Layout,
    MoEShape,
    moe_block_costs,
    transformer_block_costs,
)
from plait.schedule import schedule_kind
from plait.sim import SimPlan

__all__ = ["BlockCosts", "ModelSpec", "gpt_spec", "moe_spec", "scaled_spec"]

# (micro-batch size, layout) -> the blocks of one rank; `Layout` names the only degrees
# they may depend on, which `ModelSpec` caches them by
BlockCosts = Callable[[int, Layout], Sequence[BlockCost]]


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """What the planner needs of a model: its block costs for a micro-batch size on one
    rank of a layout (its tensor-parallel degree, sequence parallelism and expert-parallel
    degree); the head count that tp must divide; its experts per MoE layer (0: none, ep
    stays 1); whether its costs follow a sequence split over cp ranks (`context_parallel`:
    plait's GPT, described analytically; else cp stays 1)."""

    name: str
    num_blocks: int
    seq_len: int
    num_heads: int
    num_experts: int = 0
    context_parallel: bool = False
    costs: BlockCosts = field(compare=False, repr=False)
    # costs of the backward split in two passes (BI, BW), when they differ from the full
    # backward's (measured blocks: on some devices the two passes cost more than one)
    split_costs: BlockCosts | None = field(default=None, compare=False, repr=False)
    _cache: dict[tuple[int, int, bool, int, int, bool], tuple[BlockCost, ...]] = field(
        default_factory=dict, compare=False, repr=False
    )

    def blocks(
        self, micro_batch_size: int, layout: Layout, *, split: bool = False
    ) -> tuple[BlockCost, ...]:
        """The blocks of one rank of `layout`, cached by what changes them: the micro-batch
        size, the layout's degrees (`Layout`) and whether the backward is split."""
        split = split and self.split_costs is not None
        key = (micro_batch_size, layout.tp, layout.sequence_parallel, layout.ep, layout.cp, split)
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
        name=name, num_blocks=num_layers + 2, seq_len=seq_len, num_heads=num_heads,
        context_parallel=True, costs=costs,
    )  # fmt: skip


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
    tp_ratios: Mapping[tuple[int, bool], Mapping[int, tuple[float, float, float, float]]]
    | None = None,
) -> ModelSpec:
    """A model known from its blocks measured at one or more micro-batch sizes (tp = 1).

    Each cost is taken as linear in the micro-batch size through the measured points,
    a + c·b, so that the fixed cost of a call (which dominates small micro-batches on a
    CPU) is kept; with one point it is proportional. Blocks in `tp_blocks` shard under
    tensor parallelism as a Megatron layer does: work, parameters and saved activations
    divide by tp, and each pass adds two all-reduces of the block's output; the others
    are computed whole on every tensor-parallel rank. `measured_split` holds the same
    blocks with the backward timed as two passes (for zero-bubble schedules).

    `tp_ratios` (`plait.profile.sharded.TPRatios`): a sharded block measured at (tp,
    sequence parallelism), its forward and backward as shares of the whole block's, by
    micro-batch size, and the backward's input and weight halves' (which price the split
    backward; a full backward's halves take the backward's share). Where a layout's
    degree was measured, its sharded blocks take the times measured sharded (linear in
    the micro-batch size through the measured sizes, as whole blocks are), collectives
    included, instead of the division and all-reduces."""

    def builder(source: Mapping[int, Sequence[BlockCost]], split: bool = False) -> BlockCosts:
        points = sorted(source.items())
        if not points:
            raise ValueError("no measured blocks: profile the model at >= 1 micro-batch size")
        if len({len(blocks) for _, blocks in points}) != 1:
            raise ValueError("the measured profiles disagree on the number of blocks")
        sharded = frozenset(tp_blocks)

        def costs(b: int, layout: Layout) -> list[BlockCost]:
            # measured blocks have no experts and keep whole sequences
            shares = (tp_ratios or {}).get((layout.tp, layout.sequence_parallel))
            return [
                _at([(size, blocks[i]) for size, blocks in points], b,
                    layout.tp if i in sharded else 1, shares if i in sharded else None,
                    split=split)
                for i in range(len(points[0][1]))
            ]  # fmt: skip

        return costs

    count = len(next(iter(measured.values()), ()))
    return ModelSpec(
        name=name, num_blocks=count, seq_len=seq_len, num_heads=num_heads,
        costs=builder(measured),
        split_costs=builder(measured_split, split=True) if measured_split else None,
    )  # fmt: skip


_LINEAR = (
    "forward_flops", "backward_input_flops", "backward_weight_flops", "activation_bytes",
    "saved_bytes",
)  # fmt: skip


def _line(b1: float, v1: float, b2: float, v2: float, b: float) -> float:
    """The value at `b` of the line through (b1, v1) and (b2, v2) (proportional to v1 when
    b1 = b2), at least half of v1's share of `b` (a line through two noisy small times can
    fall towards zero)."""
    if b2 == b1:
        return v1 * b / b1
    slope = (v2 - v1) / (b2 - b1)
    return max(v1 + slope * (b - b1), v1 * min(1.0, b / b1) * 0.5)


def _piecewise(points: Sequence[tuple[float, float]], b: float) -> float:
    """The value at `b` of the broken line through `points` (sorted by size): the segment
    of the two measured sizes around `b`, or beyond them the nearest segment's line."""
    j = bisect.bisect_left(points, b, 1, max(1, len(points) - 1), key=lambda p: p[0])
    (b1, v1), (b2, v2) = points[max(0, j - 1)], points[j] if len(points) > 1 else points[0]
    return _line(b1, v1, b2, v2, b)


def _at(
    points: list[tuple[int, BlockCost]], b: int, tp: int,
    shares: Mapping[int, tuple[float, float, float, float]] | None = None,
    *,
    split: bool = False,
) -> BlockCost:  # fmt: skip
    """A block, measured at the sizes of `points`, at micro-batch size `b` on one of `tp`
    ranks: between two measured sizes on the line through them, beyond them on the
    nearest two's line. With `shares` (tp > 1: the sharded block's forward, backward and
    backward halves as shares of the whole one's, by micro-batch size), its time runs the
    same way through the sharded times at the measured sizes (one size: its share of the
    whole block's time), collectives included; a `split` backward's halves take their own
    shares, a full backward's the backward's."""
    b1, c1 = points[0]

    def value(field_name: str, size: float = b) -> float:
        return _piecewise([(s, float(getattr(c, field_name))) for s, c in points], size)

    at = {k: value(k) for k in _LINEAR}
    recompute = c1.saved_bytes_recompute
    kept = None if recompute is None else recompute * b / b1
    comm: tuple[Collective, ...] = ()
    forward = at["forward_flops"] / tp
    backward_input = at["backward_input_flops"] / tp
    backward_weight = at["backward_weight_flops"] / tp
    if tp > 1 and shares:  # measured sharded: its collectives are in its time

        def sharded(field_name: str, part: int) -> float:
            measured = sorted(shares.items())
            if len(measured) == 1:
                return value(field_name) * measured[0][1][part]
            return _piecewise([(s, r[part] * value(field_name, s)) for s, r in measured], b)

        forward = sharded("forward_flops", 0)
        backward_input = sharded("backward_input_flops", 2 if split else 1)
        backward_weight = sharded("backward_weight_flops", 3 if split else 1)
    elif tp > 1:
        comm = (Collective(kind="all_reduce", num_bytes=at["activation_bytes"], axis="tp"),) * 2
    return replace(
        c1,
        forward_flops=forward,
        backward_input_flops=backward_input,
        backward_weight_flops=backward_weight,
        activation_bytes=at["activation_bytes"],
        saved_bytes=at["saved_bytes"] / tp,
        saved_bytes_recompute=kept,
        num_params=c1.num_params // tp,
        forward_comm=comm,
        backward_comm=comm,
    )
