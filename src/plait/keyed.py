"""Dropout whose masks depend on (seed, step, sample, layer, position), not on the rank.

torch's dropout draws from the generator of the process that runs it, so the same run
laid out another way (more data-parallel ranks, another pipeline cut, a resume under a
new layout) drops other units and follows another trajectory. Here each element's keep
decision is a hash of its coordinates: the run's seed, the optimizer step, the sample's
index in the step's global batch, the dropout site (a hash of its name in the whole
model) and its position inside the sample. Any layout that computes an element computes
the same decision; two layouts of one run train the same model, up to reduction order.

The engine says which step and micro-batch a forward belongs to (`drawing`); outside of
it (a plain loop, evaluation) `KeyedDropout` is torch's dropout. Each sample's mask is
`torch.rand` from a generator seeded by a hash of (seed, step, sample, site), drawn whole
for the sample and cut to the part this rank holds (its heads under tensor parallelism,
its sequence shard under sequence parallelism, its zigzag chunks' global positions under
context parallelism, and in ring attention the global (query, key) positions of each
block): torch has no generator addressable per element (Philox offsets follow the order
of the draws), and one seeded generator per sample costs microseconds where hashing
every element costs a dozen passes over it. The price: a sample's whole mask is drawn,
heads × s² numbers for attention, on every rank, however the sample is split.
"""

from __future__ import annotations

import contextlib
import hashlib
import zlib
from collections.abc import Callable, Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "CpShard",
    "Draw",
    "KeyedDropout",
    "StepDraws",
    "agreed_seed",
    "assign_keys",
    "current",
    "drawing",
    "has_keyed_dropout",
    "keep_mask",
    "mask_like",
    "sample_seed",
]


@dataclass(frozen=True)
class Draw:
    """The coordinates of the forward being run: the seed, the optimizer step and the
    micro-batch's place among the step's micro-batches (its first sample is `index`
    times its rows: micro-batches of one step have equal rows)."""

    seed: int
    step: int
    index: int


# a context-parallel shard's length -> (its tokens' global positions, the global length)
CpShard = Callable[[int], tuple[torch.Tensor, int]]

_current: ContextVar[Draw | None] = ContextVar("plait_keyed_draw", default=None)


def current() -> Draw | None:
    return _current.get()


@contextlib.contextmanager
def drawing(seed: int, step: int, index: int) -> Iterator[None]:
    """Run the body as micro-batch `index` of optimizer step `step`."""
    token = _current.set(Draw(seed, step, index))
    try:
        yield
    finally:
        _current.reset(token)


def sample_seed(seed: int, step: int, site: int, sample: int) -> int:
    """The seed of one sample's mask at one dropout site (63 bits of a BLAKE2 hash)."""
    digest = hashlib.blake2b(f"{seed}:{step}:{site}:{sample}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def keep_mask(
    draw: Draw, site: int, p: float, global_shape: Sequence[int],
    offsets: Sequence[int | torch.Tensor], local_shape: Sequence[int], device: torch.device,
) -> torch.Tensor:  # fmt: skip
    """Which elements of a local block (`local_shape` at `offsets` within a tensor of
    `global_shape` [samples, ...]) are kept with probability 1 - `p`. An offset may be a
    1-D tensor of indices instead (the zigzag positions of a context-parallel shard): that
    dim of the block holds those indices, whatever `local_shape` says of it."""
    rows = int(global_shape[0])
    masks = []
    for r in range(int(local_shape[0])):
        sample = draw.index * rows + int(offsets[0]) + r
        g = torch.Generator(device=device).manual_seed(sample_seed(draw.seed, draw.step, site,
                                                                   sample))  # fmt: skip
        whole = torch.rand(tuple(global_shape[1:]), generator=g, device=device)
        masks.append(_cut(whole, offsets[1:], local_shape[1:]))
    return torch.stack(masks) >= p


def _cut(
    x: torch.Tensor, offsets: Sequence[int | torch.Tensor], shape: Sequence[int]
) -> torch.Tensor:
    for dim, (at, n) in enumerate(zip(offsets, shape, strict=True)):
        if isinstance(at, torch.Tensor):
            x = x.index_select(dim, at.to(x.device))
        else:
            x = x.narrow(dim, int(at), int(n))
    return x


class KeyedDropout(nn.Module):
    """`nn.Dropout(p)` whose mask is keyed by `drawing` (see the module docstring); its
    `site` is set by `assign_keys` from its name in the whole model."""

    def __init__(self, p: float = 0.5) -> None:
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise ValueError(f"dropout p={p} must be in [0, 1)")
        self.p, self.site = p, 0
        # (dim, index, parts): x is part `index` of `parts` equal parts along `dim` of the
        # tensor the mask is keyed over (sequence parallelism sets it); None: x is whole
        self.split: tuple[int, int, int] | None = None
        # the sequence (dim 1) split of context parallelism, set by its pass: a shard's
        # length -> (the global positions of its tokens, the global length); None: whole
        self.cp_shard: CpShard | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        draw = current()
        if not self.training or self.p == 0.0:
            return x
        if draw is None:
            return F.dropout(x, self.p, training=True)
        offsets: list[int | torch.Tensor] = [0] * x.dim()
        shape = list(x.shape)
        if self.split is not None:
            dim, index, parts = self.split
            shape[dim] = x.shape[dim] * parts
            offsets[dim] = index * x.shape[dim]
        if self.cp_shard is not None:  # the (sequence-parallel part of the) cp shard
            positions, shape[1] = self.cp_shard(shape[1])
            start = int(offsets[1])
            offsets[1] = positions[start : start + x.shape[1]]
        return x * (mask_like(x, draw, self.site, self.p, offsets, shape) / (1.0 - self.p))

    def extra_repr(self) -> str:
        return f"p={self.p}, site={self.site}"


def mask_like(
    x: torch.Tensor, draw: Draw, site: int, p: float,
    offsets: Sequence[int | torch.Tensor] | None = None,
    global_shape: Sequence[int] | None = None,
) -> torch.Tensor:  # fmt: skip
    """`x`'s keep mask as a tensor of its dtype; `offsets`/`global_shape` place a local `x`
    in the tensor the mask is keyed over (tensor-parallel heads, a sequence shard, a
    context-parallel shard's positions)."""
    shape = tuple(x.shape) if global_shape is None else tuple(global_shape)
    at = offsets if offsets is not None else (0,) * x.dim()
    return keep_mask(draw, site, p, shape, at, x.shape, x.device).to(x.dtype)


def assign_keys(model: nn.Module) -> None:
    """Give every keyed dropout (and keyed attention) of `model` a site from its name in
    the whole model: call before the model is cut into stages."""
    for name, module in model.named_modules():
        if hasattr(module, "site"):
            module.site = zlib.crc32(name.encode())


class StepDraws:
    """An engine's micro-batch ids -> their `drawing` context: micro-batch `x` (counted
    from the engine's first window) is micro-batch `first + x % m` of step
    `offset + x // m`, where this replica's `m` micro-batches of a step come after
    `first` others (of the same size) in the global batch."""

    def __init__(self, seed: int, microbatches: int, first: int) -> None:
        self.seed, self.m, self.first, self.offset = seed, microbatches, first, 0

    def __call__(self, x: int) -> contextlib.AbstractContextManager[None]:
        return drawing(self.seed, self.offset + x // self.m, self.first + x % self.m)


def has_keyed_dropout(modules: Sequence[nn.Module]) -> bool:
    """Whether any keyed dropout (or keyed attention) in `modules` drops anything."""
    return any(
        getattr(m, "p", 0.0) > 0.0 or getattr(m, "dropout", 0.0) > 0.0
        for module in modules
        for m in module.modules()
        if hasattr(m, "site")
    )


def agreed_seed(device: torch.device) -> int:
    """This process's initial seed, as rank 0 has it (every rank must key alike: tensor-
    parallel ranks drop the same units of their replicated activations)."""
    import torch.distributed as dist

    seed = torch.initial_seed() & ((1 << 62) - 1)
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return seed
    value = torch.tensor([seed], dtype=torch.int64, device=device)
    dist.broadcast(value, src=0)
    return int(value.item())
