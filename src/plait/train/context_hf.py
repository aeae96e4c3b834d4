"""Hugging Face GPT-2 and Llama attention under context parallelism: their core as the ring.

Both attention classes compute q, k and v themselves and hand them to the attention
function their config names (`ALL_ATTENTION_FUNCTIONS[config._attn_implementation]`). Under
cp each wired module gets a copy of its config naming `plait_ring`, a function registered
with transformers' `AttentionInterface` that runs `plait.parallel.context.ring_attention`
on the module's cp group (Llama's grouped key/value heads repeated first, as its eager
attention does), so the projections, rotary embedding and everything else stay Hugging
Face's own. The ring applies SDPA's scale, 1/√head_dim, and no attention dropout: a layer
scaled otherwise (GPT-2's `scale_attn_by_inverse_layer_idx`) or with attention dropout is
refused before anything runs.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = ["HF_ATTENTION", "hf_refusal", "wire_hf_attention"]

HF_ATTENTION = ("GPT2Attention", "LlamaAttention")
_RING = "plait_ring"


def _ring_interface(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: [b, h, s, d] in, [b, s, h, d] out."""
    if dropout:
        raise ValueError(f"attention dropout={dropout} under cp: set the attention dropout to 0")
    groups = int(getattr(module, "num_key_value_groups", 1))
    if groups > 1:  # grouped-query attention: each key/value head serves `groups` heads
        key, value = (t.repeat_interleave(groups, dim=1) for t in (key, value))
    ring: Callable[..., torch.Tensor] = module.plait_ring  # type: ignore[assignment]
    return ring(query, key, value).transpose(1, 2).contiguous(), None


def hf_refusal(module: Any) -> str | None:
    """Why this Hugging Face attention module cannot run as the ring, or None."""
    head_dim = int(module.head_dim)
    scaling = float(getattr(module, "scaling", head_dim**-0.5))
    if abs(scaling - head_dim**-0.5) > 1e-9 * scaling:
        return f"its scale {scaling:.6g} is not 1/√head_dim (the ring's)"
    drop = getattr(module, "attn_dropout", None)
    p = drop.p if isinstance(drop, nn.Dropout) else float(getattr(module, "attention_dropout", 0))
    if p > 0:
        return (
            f"its attention dropout is {p}, drawn by torch per process (the ring applies "
            "none): set it to 0, or use plait's GPT, whose keyed dropout works under cp"
        )
    return None


def wire_hf_attention(module: Any, ring: Callable[..., torch.Tensor]) -> None:
    """Make `module` (a GPT-2 or Llama attention) call `ring` for its core."""
    from transformers import AttentionInterface

    AttentionInterface.register(_RING, _ring_interface)
    module.plait_ring = ring
    config = copy.copy(module.config)  # the other modules of the model keep theirs
    config._attn_implementation = _RING
    module.config = config
