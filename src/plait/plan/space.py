"""The space of layouts the planner searches, and the model description it searches for."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from itertools import product

from plait.cost import BlockCost, transformer_block_costs
from plait.sim import SimPlan

__all__ = ["ModelSpec", "SearchSpace", "candidates", "degrees", "gpt_spec", "scaled_spec"]

BlockCosts = Callable[[int, int, bool], Sequence[BlockCost]]


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """What the planner needs of a model: its block costs for a micro-batch size, a
    tensor-parallel degree and sequence parallelism; the head count that tp must divide."""

    name: str
    num_blocks: int
    seq_len: int
    num_heads: int
    costs: BlockCosts = field(compare=False, repr=False)
    _cache: dict[tuple[int, int, bool], tuple[BlockCost, ...]] = field(
        default_factory=dict, compare=False, repr=False
    )

    def blocks(
        self, micro_batch_size: int, tp: int, sequence_parallel: bool
    ) -> tuple[BlockCost, ...]:
        key = (micro_batch_size, tp, sequence_parallel)
        if key not in self._cache:
            self._cache[key] = tuple(self.costs(*key))
        return self._cache[key]


def gpt_spec(
    *,
    num_layers: int,
    hidden: int,
    num_heads: int,
    seq_len: int,
    vocab_size: int,
    ffn_hidden: int = 0,
    dtype: str = "bf16",
) -> ModelSpec:
    """A GPT described analytically (any size; nothing is built)."""

    def costs(b: int, tp: int, sp: bool) -> list[BlockCost]:
        return transformer_block_costs(
            num_layers=num_layers,
            hidden=hidden,
            num_heads=num_heads,
            seq_len=seq_len,
            vocab_size=vocab_size,
            micro_batch_size=b,
            ffn_hidden=ffn_hidden,
            dtype=dtype,
            tp=tp,
            sequence_parallel=sp and tp > 1,
        )

    name = f"gpt-{num_layers}x{hidden}"
    return ModelSpec(
        name=name, num_blocks=num_layers + 2, seq_len=seq_len, num_heads=num_heads, costs=costs
    )


def scaled_spec(
    name: str, blocks: Sequence[BlockCost], *, micro_batch_size: int, seq_len: int, num_heads: int
) -> ModelSpec:
    """A model known from blocks measured at one micro-batch size (and tp = 1): costs and
    activation bytes scale linearly with the micro-batch size; tensor parallelism divides
    the work of blocks and their parameters evenly (an approximation: measured blocks do
    not say which of their parts shard)."""
    base = tuple(blocks)

    def costs(b: int, tp: int, sp: bool) -> list[BlockCost]:
        del sp
        factor = b / micro_batch_size
        return [_scale(block, factor, tp) for block in base]

    return ModelSpec(
        name=name, num_blocks=len(base), seq_len=seq_len, num_heads=num_heads, costs=costs
    )


def _scale(block: BlockCost, factor: float, tp: int) -> BlockCost:
    def opt(value: float | None, by: float) -> float | None:
        return None if value is None else value * by

    return replace(
        block,
        forward_flops=block.forward_flops * factor / tp,
        backward_input_flops=block.backward_input_flops * factor / tp,
        backward_weight_flops=block.backward_weight_flops * factor / tp,
        selective_recompute_flops=block.selective_recompute_flops * factor / tp,
        activation_bytes=block.activation_bytes * factor,
        saved_bytes=block.saved_bytes * factor / tp,
        saved_bytes_selective=opt(block.saved_bytes_selective, factor / tp),
        saved_bytes_recompute=opt(block.saved_bytes_recompute, factor),
        num_params=block.num_params // tp,
    )


@dataclass(frozen=True, kw_only=True)
class SearchSpace:
    """Which options the search tries."""

    schedules: tuple[str, ...] = ("1f1b", "gpipe", "interleaved", "zb-h1")
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

    def __post_init__(self) -> None:
        known = {"1f1b", "gpipe", "interleaved", "zb-h1"}
        bad = [s for s in self.schedules if s not in known]
        if bad or not self.schedules:
            raise ValueError(f"schedules={self.schedules}: choose from {sorted(known)}")
        if not self.micro_batch_sizes or min(self.micro_batch_sizes) < 1:
            raise ValueError(f"micro_batch_sizes={self.micro_batch_sizes} must be >= 1")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


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
        sizes = [b for b in space.micro_batch_sizes if global_batch % (dp * b) == 0]
        options = product(
            sizes,
            _schedules(space, pp, model.num_blocks),
            space.recompute,
            space.zero_stages if dp > 1 else (0,),
            space.sequence_parallel if tp > 1 else (False,),
            # the order of ranks matters only when both dp and pp split the devices
            space.rank_orders if dp > 1 and pp > 1 else space.rank_orders[:1],
        )
        for b, (kind, chunks), recompute, zero, sp, order in options:
            yield SimPlan(
                dp=dp,
                tp=tp,
                pp=pp,
                schedule=kind,
                num_microbatches=global_batch // (dp * b),
                micro_batch_size=b,
                num_chunks=chunks,
                recompute=recompute,  # type: ignore[arg-type]
                zero_stage=zero,
                dtype=space.dtype,
                sequence_parallel=sp,
                optimizer=space.optimizer,  # type: ignore[arg-type]
                seq_len=model.seq_len,
                rank_order=order,
            )


def _schedules(space: SearchSpace, pp: int, num_blocks: int) -> list[tuple[str, int]]:
    if pp == 1:  # one stage: every schedule is plain gradient accumulation
        return [("1f1b", 1)]
    out = []
    for kind in space.schedules:
        if kind == "interleaved":
            out += [(kind, v) for v in space.chunks if v >= 2 and pp * v <= num_blocks]
        else:
            out.append((kind, 1))
    return out
