"""Zigzag (head-tail) sharding of a sequence over the cp ranks: rank i of cp holds chunks i
and 2·cp − 1 − i of the sequence's 2·cp equal chunks, so every rank's share of a causal
attention's work is the same (`plait.parallel.context` attends over these shards)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["zigzag_positions", "zigzag_shard", "zigzag_unshard"]


def _check_split(seq_len: int, cp: int) -> None:
    if seq_len % (2 * cp):
        raise ValueError(
            f"seq_len={seq_len} is not divisible by 2·cp = {2 * cp}: context parallelism "
            f"cuts the sequence into 2·cp equal chunks; use a seq_len that is a multiple "
            f"of {2 * cp}"
        )


def zigzag_positions(seq_len: int, cp: int, rank: int) -> torch.Tensor:
    """The global positions of the tokens rank `rank` of `cp` holds: chunks rank and
    2·cp − 1 − rank of seq_len / (2·cp) tokens each, in that (increasing) order."""
    _check_split(seq_len, cp)
    if not 0 <= rank < cp:
        raise ValueError(f"rank={rank} is outside the cp group 0..{cp - 1}")
    c = seq_len // (2 * cp)
    head = torch.arange(rank * c, (rank + 1) * c)
    tail = torch.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c)
    return torch.cat([head, tail])


def zigzag_shard(x: torch.Tensor, cp: int, rank: int, *, dim: int = 1) -> torch.Tensor:
    """This rank's two chunks of `x` along `dim` (the sequence)."""
    index = zigzag_positions(x.shape[dim], cp, rank).to(x.device)
    return x.index_select(dim, index)


def zigzag_unshard(parts: Sequence[torch.Tensor], *, dim: int = 1) -> torch.Tensor:
    """The whole sequence from every rank's shard (rank order): inverse of `zigzag_shard`."""
    cp = len(parts)
    seq_len = sum(p.shape[dim] for p in parts)
    order = torch.cat([zigzag_positions(seq_len, cp, r) for r in range(cp)])
    whole = torch.cat(list(parts), dim=dim)
    return whole.index_select(dim, torch.argsort(order).to(whole.device))
