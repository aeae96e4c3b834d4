"""Activation recomputation (Chen et al. 2016; Korthikanti et al. 2022) per block.

"full" wraps every block with torch's checkpoint wrapper: only the block's input is kept
and its forward runs again during backward. "selective" asks blocks that support it (an
attribute `recompute_core`, as the reference GPT's attention has) to recompute only the
attention core, which holds most activation memory for the least compute.
"""

from __future__ import annotations

from torch import nn

from plait.compat import CheckpointImpl, checkpoint_wrapper

__all__ = ["apply_recompute"]


def apply_recompute(stage: nn.Module, mode: str) -> None:
    """Apply recomputation `mode` ("none", "selective", "full") to the blocks of `stage`."""
    if mode == "none":
        return
    blocks = getattr(stage, "blocks", None)
    if not isinstance(blocks, nn.ModuleList):
        raise TypeError(f"{type(stage).__name__} has no `.blocks` list: pass a StageModule")
    if mode == "full":
        for i, block in enumerate(blocks):
            blocks[i] = checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
        return
    if mode == "selective":
        for module in stage.modules():
            if hasattr(module, "recompute_core"):
                setattr(module, "recompute_core", True)  # noqa: B010
        return
    raise ValueError(f"recompute={mode!r} must be 'none', 'selective' or 'full'")
