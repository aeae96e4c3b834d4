"""Models as ordered lists of blocks that can be cut into pipeline stages.

A block is an `nn.Module` whose forward takes one value, the previous block's output: a
tensor, or a tuple or dict of tensors when a stage boundary carries several (a skip
connection that jumps over a stage is simply an extra entry passed along). The first
block takes the micro-batch input; the last returns what the loss function consumes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from torch import nn

__all__ = [
    "BlockChain",
    "StageModule",
    "as_blocks",
    "block_names",
    "block_params",
    "equal_split",
    "stage_modules",
]


def as_blocks(model: nn.Module) -> list[nn.Module]:
    """The ordered blocks of `model`: an `nn.Sequential`'s children, or `model.blocks()`."""
    if isinstance(model, nn.Sequential):
        return list(model.children())
    blocks = getattr(model, "blocks", None)
    if callable(blocks):
        out = list(blocks())
        if not all(isinstance(b, nn.Module) for b in out):
            raise TypeError(f"{type(model).__name__}.blocks() must return nn.Module objects")
        return out
    raise TypeError(
        f"{type(model).__name__} cannot be cut into pipeline stages: pass an nn.Sequential, "
        "or give the model a `blocks()` method returning its layers in order"
    )


def block_names(model: nn.Module) -> list[str]:
    """The name each block of `model` has in the whole model (`layers.3`, or `3` for an
    `nn.Sequential`): the prefix of its parameters' global names."""
    names = {id(module): name for name, module in model.named_modules()}
    return [names[id(block)] for block in as_blocks(model)]


class BlockChain(nn.Module):
    """A model that is its blocks run in order: a subclass builds `layers` (a list of
    modules, kept as `self.layers`, so checkpoints name them `layers.i`) and gets
    `blocks()` and `forward()`."""

    def __init__(self, layers: Sequence[nn.Module]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def blocks(self) -> list[nn.Module]:
        return list(self.layers)

    def forward(self, x: object) -> object:
        for layer in self.layers:
            x = layer(x)
        return x


class StageModule(nn.Module):
    """Consecutive blocks run one after another; one (virtual) pipeline stage."""

    def __init__(self, blocks: Sequence[nn.Module], *, first_block: int = 0) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.first_block = first_block

    def forward(self, x: object) -> object:
        for block in self.blocks:
            x = block(x)
        return x


def equal_split(num_blocks: int, num_stages: int) -> list[int]:
    """Block counts per stage, as equal as possible (earlier stages get the remainder)."""
    if num_stages > num_blocks:
        raise ValueError(
            f"{num_blocks} blocks cannot fill {num_stages} stages: use a model with at least "
            f"{num_stages} blocks, or fewer pipeline ranks × chunks"
        )
    base, extra = divmod(num_blocks, num_stages)
    return [base + (1 if s < extra else 0) for s in range(num_stages)]


def stage_modules(blocks: Sequence[nn.Module], sizes: Sequence[int]) -> list[StageModule]:
    """Cut `blocks` into consecutive stages of `sizes[i]` blocks each."""
    if sum(sizes) != len(blocks) or any(n < 1 for n in sizes):
        raise ValueError(
            f"stage sizes {list(sizes)} must be positive and add up to {len(blocks)} blocks"
        )
    out, start = [], 0
    for n in sizes:
        out.append(StageModule(blocks[start : start + n], first_block=start))
        start += n
    return out


def block_params(stages: Mapping[int, nn.Module]) -> list[tuple[int, list[nn.Parameter]]] | None:
    """(global block index, its trainable parameters) of every block in `stages`, from each
    `StageModule`'s `first_block`; None when a stage is not one (a wrapped or custom stage)."""
    out = []
    for stage in stages.values():
        if not isinstance(stage, StageModule):
            return None
        for i, block in enumerate(stage.blocks):
            out.append((stage.first_block + i, [p for p in block.parameters() if p.requires_grad]))
    return out
