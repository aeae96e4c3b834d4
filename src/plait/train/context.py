"""The context-parallel pass: what cp > 1 refuses, and how it wires plait's GPT to the ring.

Under cp > 1 the engine gives each rank its zigzag chunks of the sequence
(`plait.train.engine.Engine._shard`); this pass makes the model read them as such: the
token embedding takes the chunks' global positions, and each causal self-attention runs
as ring attention on the cp group (`plait.parallel.context`). Keyed dropout
(`plait.keyed`) learns the same positions: each dropout keys its mask by its tokens'
global positions, attention dropout by the global (query, key) position of each
probability, so a cp run drops what one process drops. Gradients are reduced
over dp × cp (`plait.mesh.Meshes.grad_dp`). What is not built yet is refused here,
before the model is touched, naming the fix.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from plait.models.gpt import Attention, Head, TokenEmbedding
from plait.models.hf import _Head as HFHead
from plait.models.moe import Experts
from plait.parallel.context import ring_attention, zigzag_positions
from plait.schedule.registry import schedule_kind
from plait.train.context_hf import HF_ATTENTION, hf_refusal, wire_hf_attention

__all__ = ["apply_context_parallel", "check_model", "cp_refusal"]


def cp_refusal(plan: Any, *, compile: bool = False, mesh_given: bool = False) -> str | None:
    """Why `plan` (cp > 1) cannot train yet, with the fix; None when it can."""
    cp = plan.cp
    others = [
        (plan.ep > 1, f"ep={plan.ep} (MoE)", "ep=1"),
        (not schedule_kind(plan.schedule).synchronous, f"schedule={plan.schedule!r}",
         "a synchronous schedule"),
        (plan.compress != "none", f"compress={plan.compress!r}", "compress='none'"),
        (plan.dp_replicate not in (None, 1) and plan.dp_shard not in (None, 1),
         "HSDP (dp_replicate and dp_shard > 1)", "one data-parallel axis"),
        (compile, "compile", "no compile"),
        (mesh_given, "a mesh given", "mesh=None (the dp × cp view is built with the mesh)"),
    ]  # fmt: skip
    for refused, what, fix in others:
        if refused:
            return f"cp={cp} with {what} is not supported yet: use {fix}, or cp=1"
    return None


def apply_context_parallel(stages: dict[int, nn.Module], group: dist.ProcessGroup) -> None:
    """Wire every stage's GPT (or Hugging Face GPT-2/Llama) attention to the ring of
    `group` and its embeddings (Llama: its rotary positions) to the global positions of
    this rank's chunks, and keyed dropout (plait's GPT: embedding, residual, MLP and
    attention) to them too. Raises ValueError on a model it cannot wire."""
    cp, index = dist.get_world_size(group), dist.get_rank(group)
    check_model(stages, cp)
    ring = functools.partial(ring_attention, group=group)
    shard = functools.partial(_shard, cp=cp, rank=index)
    for stage in stages.values():
        for module in stage.modules():
            if hasattr(module, "cp_shard"):  # keyed dropout, plait's attention
                setattr(module, "cp_shard", shard)  # noqa: B010 (a plain attribute)
            if isinstance(module, Attention):
                module.ring = ring
            elif type(module).__name__ in HF_ATTENTION:
                wire_hf_attention(module, ring)
            if hasattr(module, "positions_of"):  # plait's and the Hugging Face embeddings
                positions = functools.partial(_positions, cp=cp, rank=index)
                setattr(module, "positions_of", positions)  # noqa: B010 (a plain attribute)


def check_model(stages: Mapping[int, nn.Module], cp: int) -> None:
    """Raise ValueError (naming the module and the fix) unless cp can wire these stages:
    plait's GPT or Hugging Face GPT-2/Llama parts (these without attention dropout), no
    experts, no other attention."""
    found = 0  # the GPT parts: a stage of another model has none
    for stage in stages.values():
        for name, module in stage.named_modules():
            _refuse_module(name, module, cp)
            # a last stage may hold the head alone
            found += isinstance(module, (Attention, TokenEmbedding, Head, HFHead))
            found += type(module).__name__ in HF_ATTENTION or hasattr(module, "positions_of")
    if not found:
        raise ValueError(
            f"cp={cp} found no causal self-attention it can run as a ring: context "
            "parallelism supports plait's GPT and the Hugging Face GPT-2 and Llama blocks so "
            "far; use one, or cp=1"
        )


def _positions(local_len: int, *, cp: int, rank: int) -> torch.Tensor:
    return zigzag_positions(local_len * cp, cp, rank)


def _shard(local_len: int, *, cp: int, rank: int) -> tuple[torch.Tensor, int]:
    return zigzag_positions(local_len * cp, cp, rank), local_len * cp


def _refuse_module(name: str, module: nn.Module, cp: int) -> None:
    if isinstance(module, Experts):
        raise ValueError(
            f"cp={cp} with a mixture of experts (at {name!r}) is not supported yet: its "
            "router's balance loss would count each rank's tokens alone; use a dense GPT, "
            "or cp=1"
        )
    kind = type(module).__name__
    why = hf_refusal(module) if kind in HF_ATTENTION else None
    if why is not None:
        raise ValueError(f"cp={cp} cannot run {kind} (at {name!r}) as ring attention: {why}")
    if (
        kind.endswith("Attention")
        and not isinstance(module, Attention)
        and kind not in HF_ATTENTION
    ):
        raise ValueError(
            f"cp={cp} cannot run {kind} (at {name!r}) as ring attention: context parallelism "
            "supports plait's GPT and the Hugging Face GPT-2 and Llama blocks so far; use one, "
            "or cp=1"
        )
