"""The one module that names torch's private APIs, each with a fallback per supported torch version.

plait supports torch 2.11 to 2.13 (`pyproject.toml`; 2.13 is what the CPU tests pin, GPU
hosts here run 2.11). It uses public torch wherever torch has one; what follows has no
public equivalent, so it is named here once, and `tests/unit/test_compat.py` fails loudly,
naming the attribute, when a torch release moves one:

- FSDP2's end of backward (`fsdp_post_backward`): a pipeline runs one backward per
  micro-batch from a stage's output rather than from a loss, so FSDP's own final callback
  never fires; plait calls the hooks by hand, as torch.distributed.pipelining's stage
  does. torch 2.11 keeps one `_fsdp_param_group` per state; later releases a list,
  `_fsdp_param_groups`.
- pipelining's split backward (`stage_backward_input`, `stage_backward_weight` and the
  graph helpers behind them), the zero-bubble BI/BW passes.
- the profiler-is-recording flag (`profiler_enabled`): labelling every action costs
  microseconds even when nothing records.
- the checkpoint wrapper of full recomputation (`checkpoint_wrapper`, `CheckpointImpl`).
- pytree (`pytree`), torch's structure flattening, stable across these releases.
- the device types with fused optimizer kernels (`fused_optimizer_devices`), which torch
  checks itself only when an optimizer is built.
- AOTAutograd's donated buffers (`keep_compiled_backward_graphs`): a compiled block's
  backward frees its saved buffers as it runs, which a split backward (zero-bubble BI,
  then BW on the same graph) cannot allow.
- fp16's unscale-and-inf-check kernel (`amp_unscale_`), the one `torch.amp.GradScaler`
  and FSDP's `ShardedGradScaler` call; plait calls it on all of a rank's gradients at once.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    checkpoint_wrapper,
)
from torch.distributed.pipelining._backward import (
    _get_grad_fn_or_grad_acc,
    construct_reverse_graph,
    get_param_groups,
    stage_backward_input,
    stage_backward_weight,
)
from torch.utils import _pytree as pytree
from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

__all__ = [
    "PRIVATE_NAMES",
    "CheckpointImpl",
    "amp_unscale_",
    "checkpoint_wrapper",
    "construct_reverse_graph",
    "fsdp_param_groups",
    "fsdp_post_backward",
    "fused_optimizer_devices",
    "get_grad_fn_or_grad_acc",
    "get_param_groups",
    "keep_compiled_backward_graphs",
    "profiler_enabled",
    "pytree",
    "stage_backward_input",
    "stage_backward_weight",
]

get_grad_fn_or_grad_acc = _get_grad_fn_or_grad_acc
# (gradients, found_inf, inv_scale): gradients *= inv_scale; found_inf = 1 if any is not finite
amp_unscale_ = torch._amp_foreach_non_finite_check_and_unscale_

#: (module, attribute) of every private name above, for the test that checks them
PRIVATE_NAMES = (
    ("torch.distributed.algorithms._checkpoint.checkpoint_wrapper", "checkpoint_wrapper"),
    ("torch.distributed.algorithms._checkpoint.checkpoint_wrapper", "CheckpointImpl"),
    ("torch.distributed.pipelining._backward", "_get_grad_fn_or_grad_acc"),
    ("torch.distributed.pipelining._backward", "construct_reverse_graph"),
    ("torch.distributed.pipelining._backward", "get_param_groups"),
    ("torch.distributed.pipelining._backward", "stage_backward_input"),
    ("torch.distributed.pipelining._backward", "stage_backward_weight"),
    ("torch.autograd.profiler", "_is_profiler_enabled"),
    ("torch.utils._pytree", "tree_flatten"),
    ("torch.utils._pytree", "treespec_dumps"),
    ("torch.distributed.fsdp._fully_shard._fsdp_state", "FSDPState"),
    ("torch.utils._foreach_utils", "_get_fused_kernels_supported_devices"),
    ("torch", "_amp_foreach_non_finite_check_and_unscale_"),
    ("torch._functorch.config", "donated_buffer"),
)


def keep_compiled_backward_graphs() -> None:
    """Let compiled backwards run with `retain_graph=True` (no donated buffers) in this
    process, for blocks compiled from now on."""
    import torch._functorch.config as functorch_config

    functorch_config.donated_buffer = False


def fused_optimizer_devices() -> list[str]:
    """The device types torch's fused optimizer kernels run on."""
    return list(_get_fused_kernels_supported_devices())


def profiler_enabled() -> bool:
    """Whether a torch profiler is recording now."""
    return bool(torch.autograd.profiler._is_profiler_enabled)


def fsdp_param_groups(state: Any) -> list[Any]:
    """An FSDP state's parameter groups: a list from torch 2.12 on, at most one before."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = getattr(state, "_fsdp_param_group", None)
    return [group] if group is not None else []


def fsdp_post_backward(module: Any) -> None:
    """Run FSDP2's post-backward for `module` (a `fully_shard`-ed stage) and every module
    sharded inside it, then its final callback: the gradients are reduce-scattered."""
    from torch.distributed.fsdp import fully_shard

    state = fully_shard.state(module)  # type: ignore[attr-defined]
    for inner in state._state_ctx.all_states:
        for group in fsdp_param_groups(inner):
            group.post_backward()
    state._root_post_backward_final_callback()
