"""`--compile`: torch.compile each block of a pipeline stage, in place.

torchtitan compiles per transformer block (its `apply_compile`), after activation
checkpointing and before FSDP, so that the repeated structure compiles once;
`plait.parallelize` calls `apply_compile` at that place in its order (tensor parallelism,
recomputation, compile, ZeRO-2/3), one pass over the stage's blocks. Each block is
compiled with `nn.Module.compile`, which keeps the module and its parameter names
(checkpoints, ZeRO and the weight store see the same module), rather than
`torch.compile(block)`, whose wrapper would prefix every name with `_orig_mod`. Blocks of
one class share their compiled code (torch inlines built-in modules, so parameters are
graph inputs rather than constants).

Limits: the compiled code is torch's; plait only places it. A copy of a compiled block
(the weight versions of asynchronous schedules, `plait.runtime.weights`) runs eagerly,
since torch drops a module's compiled call when it is copied. Zero-bubble schedules'
split backward still gives exact gradients, but the weight pass runs the block's whole
compiled backward again (a compiled block is one autograd node), and compiled backwards
keep their saved buffers for it (no donated buffers, for every schedule: the compiled
code is shared by all engines of a process). Activation offload's saved-tensor hooks
apply to the compiled blocks' saved tensors. Expert parallelism (collectives inside the
blocks) is refused with compile (`compile_refusal`, asked by the compile pass).
"""

from __future__ import annotations

from torch import nn

from plait.compat import keep_compiled_backward_graphs

__all__ = ["apply_compile", "compile_refusal"]


def apply_compile(stage: nn.Module) -> None:
    """torch.compile every block of `stage` (a `plait.runtime.StageModule`) in place."""
    blocks = getattr(stage, "blocks", None)
    if not isinstance(blocks, nn.ModuleList):
        raise TypeError(f"{type(stage).__name__} has no `.blocks` list: pass a StageModule")
    # zero-bubble schedules run a backward in two passes over one graph (BI, then BW),
    # which compiled backwards that free their buffers as they go (AOTAutograd's
    # donated buffers) cannot serve; set for every schedule, since compiled code is
    # shared by every engine of the process (a bit more memory in the backward)
    keep_compiled_backward_graphs()
    for block in blocks:
        block.compile()


def compile_refusal(*, ep: int) -> str | None:
    """What `apply_compile` is not known to compose with, and the fix; None if nothing."""
    if ep > 1:
        return (
            f"compile with ep={ep}: the experts' all-to-all inside the blocks is not "
            "compiled by plait yet; use ep=1 or drop compile"
        )
    return None
