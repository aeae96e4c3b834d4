"""The cost record of one block and of a stage (contiguous blocks), and their times on a device.

A block's work is counted in FLOPs per micro-batch, whether it was derived analytically
(`plait.cost.transformer`) or measured in seconds on a reference device and converted with
`BlockCost.from_seconds`, so one record serves any device: time = FLOPs / achievable FLOP/s.
Bytes are per micro-batch and per tensor-parallel rank.

Limits: time is linear in FLOPs (a block that is memory-bound on one device and compute-
bound on another scales wrongly); a measured block keeps its reference device's mix.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from itertools import pairwise
from typing import Literal, Protocol

from plait.cluster import Device
from plait.cost.comm import AxisLinks, Collective
from plait.cost.context import RingExchange, ring_exposed_s

__all__ = [
    "RECOMPUTE_MODES",
    "BlockCost",
    "Layout",
    "Recompute",
    "StageCost",
    "StageTimes",
    "block_times",
    "check_recompute",
    "stage_costs",
]

Recompute = Literal["none", "selective", "full"]
RECOMPUTE_MODES: tuple[str, ...] = ("none", "selective", "full")


class Layout(Protocol):
    """What of a layout changes a block's cost: the tensor-parallel degree, sequence
    parallelism, the expert-parallel degree and the context-parallel degree. The layout
    is `plait.config.ParallelPlan` (the simulator's `plait.sim.SimPlan`); the cost model
    names only the degrees it
    reads, so that whatever caches block costs by layout keys on exactly these, and so
    that `cost` stays below `config`, whose import brings the schedule registry."""

    @property
    def tp(self) -> int: ...

    @property
    def sequence_parallel(self) -> bool: ...

    @property
    def ep(self) -> int: ...

    @property
    def cp(self) -> int: ...


def check_recompute(recompute: str) -> None:
    """Raise ValueError unless `recompute` is one of `RECOMPUTE_MODES`."""
    if recompute not in RECOMPUTE_MODES:
        raise ValueError(f"recompute={recompute!r} is unknown; use one of {RECOMPUTE_MODES}")


@dataclass(frozen=True, kw_only=True)
class BlockCost:
    """Work and bytes of one block for one micro-batch on one tensor-parallel rank.

    Backward is split as zero-bubble schedules need it (Qi et al. 2024): `backward_input`
    computes the gradients of the block input (on the pipeline's critical path),
    `backward_weight` those of the weights. Memory kept from forward to backward depends on
    recomputation (Chen et al. 2016; Korthikanti et al. 2022): `saved_bytes` with none,
    `saved_bytes_selective` (default: `saved_bytes`) when only cheap-to-store, costly-to-
    keep parts are recomputed at `selective_recompute_flops`, `saved_bytes_recompute`
    (default: `activation_bytes`, the size of a residual block's input) with full
    recomputation, which repeats the forward. `forward_comm`/`backward_comm` are the
    collectives the block issues over its tensor-parallel group (repeated in backward
    when the forward is recomputed). `expert_params` are the parameters among `num_params`
    that belong to this rank's experts (`plait.cost.moe`): their gradients are averaged
    over the expert-data-parallel group (dp·tp / ep ranks) instead of all dp ranks.
    `ring` is the block's context-parallel K/V ring (`plait.cost.context`), whose
    transfers its attention partly hides.
    """

    name: str
    forward_flops: float
    backward_input_flops: float
    backward_weight_flops: float = 0.0
    activation_bytes: float = 0.0
    saved_bytes: float = 0.0
    saved_bytes_selective: float | None = None
    selective_recompute_flops: float = 0.0
    saved_bytes_recompute: float | None = None
    num_params: int = 0
    expert_params: int = 0
    forward_comm: tuple[Collective, ...] = ()
    backward_comm: tuple[Collective, ...] = ()
    ring: RingExchange | None = None
    source: str = "analytic"

    def __post_init__(self) -> None:
        for name in (
            "forward_flops",
            "backward_input_flops",
            "backward_weight_flops",
            "activation_bytes",
            "saved_bytes",
            "selective_recompute_flops",
            "num_params",
            "expert_params",
            "saved_bytes_selective",
            "saved_bytes_recompute",
        ):
            value = getattr(self, name)
            if value is not None and not value >= 0:
                raise ValueError(f"block {self.name!r}: {name}={value!r} must be >= 0")
        if self.expert_params > self.num_params:
            raise ValueError(
                f"block {self.name!r}: expert_params={self.expert_params} exceeds "
                f"num_params={self.num_params} (experts are part of the block's parameters)"
            )
        object.__setattr__(self, "forward_comm", tuple(self.forward_comm))
        object.__setattr__(self, "backward_comm", tuple(self.backward_comm))

    @staticmethod
    def from_seconds(
        name: str,
        *,
        forward_s: float,
        backward_input_s: float,
        backward_weight_s: float,
        device: Device,
        dtype: str,
        activation_bytes: float = 0.0,
        saved_bytes: float = 0.0,
        saved_bytes_recompute: float | None = None,
        num_params: int = 0,
    ) -> BlockCost:
        """A block measured on `device` in `dtype` (what the profiler returns): seconds
        become FLOPs at that device's achievable rate, so `StageCost.times` on the same
        device gives them back and other devices scale them by their speed."""
        rate = device.achievable_flops(dtype)
        return BlockCost(
            name=name,
            forward_flops=forward_s * rate,
            backward_input_flops=backward_input_s * rate,
            backward_weight_flops=backward_weight_s * rate,
            activation_bytes=activation_bytes,
            saved_bytes=saved_bytes,
            saved_bytes_recompute=saved_bytes_recompute,
            num_params=num_params,
            source=f"measured on {device.name} ({dtype})",
        )

    def saved_for(self, recompute: Recompute) -> float:
        """Bytes kept from this block's forward to its backward under `recompute`."""
        if recompute == "full":
            kept = self.saved_bytes_recompute
            return min(self.saved_bytes, self.activation_bytes) if kept is None else kept
        if recompute == "selective" and self.saved_bytes_selective is not None:
            return self.saved_bytes_selective
        return self.saved_bytes

    def recompute_flops(self, recompute: Recompute) -> float:
        """Forward work repeated before the backward under `recompute`."""
        if recompute == "full":
            return self.forward_flops
        return self.selective_recompute_flops if recompute == "selective" else 0.0


@dataclass(frozen=True)
class StageTimes:
    """Seconds one micro-batch spends in a stage: compute plus its in-block collectives."""

    forward_s: float
    backward_input_s: float  # includes recomputation and its repeated collectives
    backward_weight_s: float
    comm_forward_s: float  # collectives inside forward_s
    comm_backward_s: float  # collectives inside backward_input_s
    # of the collectives above, the expert all-to-alls (forward and backward, per micro-batch)
    ep_comm_s: float = 0.0
    # the context-parallel ring's transfers attention does not hide (forward and backward,
    # per micro-batch; inside forward_s and backward_input_s, not in comm_*_s)
    cp_comm_s: float = 0.0

    @property
    def backward_s(self) -> float:
        return self.backward_input_s + self.backward_weight_s


@dataclass(frozen=True)
class StageCost:
    """A pipeline stage: contiguous blocks, whose work and bytes add up."""

    blocks: tuple[BlockCost, ...]
    forward_flops: float = field(init=False)
    backward_input_flops: float = field(init=False)
    backward_weight_flops: float = field(init=False)
    num_params: int = field(init=False)
    expert_params: int = field(init=False)

    def __post_init__(self) -> None:
        if not self.blocks:
            raise ValueError("a stage needs at least one block")
        object.__setattr__(self, "blocks", tuple(self.blocks))
        for name in ("forward_flops", "backward_input_flops", "backward_weight_flops"):
            object.__setattr__(self, name, sum(getattr(b, name) for b in self.blocks))
        object.__setattr__(self, "num_params", sum(b.num_params for b in self.blocks))
        object.__setattr__(self, "expert_params", sum(b.expert_params for b in self.blocks))

    @staticmethod
    def of(item: StageCost | BlockCost) -> StageCost:
        return item if isinstance(item, StageCost) else StageCost((item,))

    @property
    def name(self) -> str:
        first, last = self.blocks[0].name, self.blocks[-1].name
        return first if first == last else f"{first}..{last}"

    @property
    def activation_bytes(self) -> float:
        """Bytes the stage sends forward (and receives back as gradients) per micro-batch."""
        return self.blocks[-1].activation_bytes

    @property
    def model_flops(self) -> float:
        """Forward plus backward work per micro-batch, recomputation excluded."""
        return self.forward_flops + self.backward_input_flops + self.backward_weight_flops

    def saved_bytes(self, recompute: Recompute) -> float:
        """Bytes one in-flight micro-batch keeps on this stage."""
        return sum(b.saved_for(recompute) for b in self.blocks)

    def transient_bytes(self, recompute: Recompute) -> float:
        """Extra bytes alive while one block's activations are rebuilt for its backward
        (recomputation goes block by block, as Megatron's per-layer checkpointing)."""
        if recompute == "none":
            return 0.0
        return max(b.saved_bytes - b.saved_for(recompute) for b in self.blocks)

    def times(
        self,
        device: Device,
        dtype: str,
        *,
        recompute: Recompute = "none",
        links: AxisLinks | None = None,
    ) -> StageTimes:
        """Per-micro-batch seconds on `device`; each collective runs over its axis's group
        in `links`, the layout's degrees and the cluster's links (None: one rank, no
        collective costs anything)."""
        check_recompute(recompute)
        rate = device.achievable_flops(dtype)
        comm = (links or AxisLinks()).time

        fwd = [c for b in self.blocks for c in b.forward_comm]
        bwd = [c for b in self.blocks for c in b.backward_comm]
        fwd_comm, bwd_comm = comm(fwd), comm(bwd)
        ep_fwd = comm([c for c in fwd if c.axis == "ep"]) if fwd_comm else 0.0
        ep_comm = ep_fwd + (comm([c for c in bwd if c.axis == "ep"]) if bwd_comm else 0.0)
        ring_fwd, ring_bwd = self._ring_s(links, rate)
        if recompute == "full":
            bwd_comm += fwd_comm
            ep_comm += ep_fwd
            ring_bwd += ring_fwd
        redo = sum(b.recompute_flops(recompute) for b in self.blocks)
        return StageTimes(
            forward_s=self.forward_flops / rate + fwd_comm + ring_fwd,
            backward_input_s=(self.backward_input_flops + redo) / rate + bwd_comm + ring_bwd,
            backward_weight_s=self.backward_weight_flops / rate,
            comm_forward_s=fwd_comm,
            comm_backward_s=bwd_comm,
            ep_comm_s=ep_comm,
            cp_comm_s=ring_fwd + ring_bwd,
        )

    def _ring_s(self, links: AxisLinks | None, rate: float) -> tuple[float, float]:
        """(forward, backward) seconds of the blocks' cp ring transfers left exposed."""
        rings = [b.ring for b in self.blocks if b.ring is not None]
        if not rings or links is None:
            return 0.0, 0.0
        _, link = links.group("cp")
        exposed = [ring_exposed_s(r, link, rate) for r in rings]
        return sum(f for f, _ in exposed), sum(b for _, b in exposed)


def stage_costs(blocks: Sequence[BlockCost], boundaries: Sequence[int]) -> list[StageCost]:
    """Cut `blocks` at `boundaries` (0 = b_0 < b_1 < ... < b_k = len(blocks)) into k stages."""
    cuts = list(boundaries)
    if len(cuts) < 2 or cuts[0] != 0 or cuts[-1] != len(blocks):
        raise ValueError(
            f"boundaries={cuts} must start at 0 and end at {len(blocks)} (the number of blocks)"
        )
    if any(a >= b for a, b in pairwise(cuts)):
        raise ValueError(f"boundaries={cuts} must increase strictly: every stage needs a block")
    return [StageCost(tuple(blocks[a:b])) for a, b in pairwise(cuts)]


def block_times(
    blocks: Sequence[BlockCost],
    device: Device,
    dtype: str,
    *,
    recompute: Recompute = "none",
    links: AxisLinks | None = None,
) -> list[StageTimes]:
    """`StageCost.times` of each block alone, each kind of block priced once: a model's
    blocks are mostly alike (its layers), and the planner prices tens of thousands of
    layouts' worth of them (a block's name does not change its times)."""
    priced: dict[tuple[object, ...], StageTimes] = {}
    out = []
    for b in blocks:
        like = tuple(getattr(b, name) for name in _PRICED)
        if like not in priced:
            priced[like] = StageCost((b,)).times(device, dtype, recompute=recompute, links=links)
        out.append(priced[like])
    return out


_PRICED = tuple(f.name for f in fields(BlockCost) if f.name != "name")
