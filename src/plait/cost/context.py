"""Context parallelism's ring exchange per layer, and the part of it attention does not hide.

Under context parallelism (`plait.parallel.context`) each of the cp ranks of a ring holds
b·s/cp tokens of every sequence (two zigzag chunks) and its attention needs every other
rank's keys and values: in forward the K and V blocks of the local chunk travel cp − 1
steps around the ring, each step's transfer overlapped with the attention of the block
received before it (Liu et al. 2023, "Ring Attention with Blockwise Transformers"). So a
layer's forward takes, per step, max(transfer, block attention), that is its attention
plus cp − 1 times max(0, transfer − block attention). The backward passes the K and V
blocks again (cp − 1 steps, each overlapped with one block's gradients) and the dK/dV
accumulators with them, one step behind, which come home after cp transfers: the last
one waits on nothing.

Bytes: a K or V block is b·(s/cp)·(h/tp) elements; plait's ring computes and sends in
fp32 whatever the training dtype (its softmax merges need the precision), so elements are
4 bytes. Attention per step is 1/cp of the rank's attention FLOPs: under zigzag every step
after the first is c × 2c scores (c = s/(2cp)), the own block's causal half of 2c × 2c
the same. One step's transfer costs the link of the cp group (latency + bytes/bandwidth:
each rank sends one block to the next and receives one from the previous at once).

Limits: the transfers and the attention are assumed to share no resource (on a GPU the
copy engines, not the SMs, move the data); the zigzag chunks' exact causal balance is
taken as perfect.
"""

from __future__ import annotations

from dataclasses import dataclass

from plait.cluster import Link

__all__ = ["RING_BYTES", "RingExchange", "ring_exposed_s"]

RING_BYTES = 4  # plait's ring attention computes and sends its blocks in fp32


@dataclass(frozen=True, kw_only=True)
class RingExchange:
    """One layer's ring traffic per micro-batch on one rank of a cp group of `cp` ranks:
    a K or V block is `block_bytes`; `forward_flops` and `backward_flops` are the layer's
    attention work per rank (each step does 1/cp of it)."""

    cp: int
    block_bytes: float
    forward_flops: float
    backward_flops: float

    def __post_init__(self) -> None:
        if self.cp < 1:
            raise ValueError(f"cp={self.cp} must be >= 1")
        for name in ("block_bytes", "forward_flops", "backward_flops"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name}={getattr(self, name)!r} must be >= 0")

    @property
    def forward_bytes(self) -> float:
        """Bytes one rank sends in forward: K and V, cp − 1 times."""
        return 2 * (self.cp - 1) * self.block_bytes

    @property
    def backward_bytes(self) -> float:
        """Bytes one rank sends in backward: K and V cp − 1 times, dK and dV cp times."""
        return 2 * (self.cp - 1) * self.block_bytes + 2 * self.cp * self.block_bytes


def ring_exposed_s(ring: RingExchange, link: Link | None, rate: float) -> tuple[float, float]:
    """(forward, backward) seconds of `ring`'s transfers that its attention at `rate`
    FLOP/s does not hide, over the cp group's `link` (None: one rank, nothing)."""
    if ring.cp == 1 or link is None:
        return 0.0, 0.0
    steps = ring.cp - 1
    fwd_step = link.time(2 * ring.block_bytes)  # K and V
    bwd_step = link.time(4 * ring.block_bytes)  # K and V, and the previous block's dK, dV
    fwd = steps * max(0.0, fwd_step - ring.forward_flops / ring.cp / rate)
    bwd = steps * max(0.0, bwd_step - ring.backward_flops / ring.cp / rate)
    return fwd, bwd + link.time(2 * ring.block_bytes)  # the own block's dK, dV come home
