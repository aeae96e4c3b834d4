"""The peer the MoE bench compares plait's expert layer against: torchtitan's MoE, built
with the same router weight and expert slices, and how to install it."""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import nn

    from plait.bench.moe_config import MoEBenchConfig

__all__ = ["INSTALL", "PEER", "peer_layer", "peer_loss", "peer_version", "routing_agrees"]

PEER = "torchtitan"
INSTALL = (
    "pip install --no-deps -c constraints.txt torchtitan==0.3.0 spmd_types==0.2.3 "
    "tyro==1.0.17 docstring_parser==0.18.0 triton==3.9.0"
)


def peer_version() -> str | None:
    """torchtitan's version when its MoE layer imports here, else None."""
    try:
        import importlib.metadata

        from torchtitan.models.common.moe import MoE  # noqa: F401
    except ImportError:
        return None
    return importlib.metadata.version(PEER)


def peer_loss(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    y = layer(x.unsqueeze(0))  # torchtitan takes [batch, seq, hidden]
    y.square().mean().backward()
    return y.detach().squeeze(0)


def peer_layer(
    config: MoEBenchConfig, gate: torch.Tensor, rank: int, world: int, device: torch.device
) -> Any:
    """torchtitan's MoE with `gate` as its router weight and this rank's slice of experts,
    wired to an ep mesh of all workers (none for one worker: its local dispatcher)."""
    import torch
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torchtitan.distributed.utils import set_spmd_backend
    from torchtitan.models.common.linear import Linear
    from torchtitan.models.common.moe import (
        GroupedExperts,
        MoE,
        RoutedExperts,
        TokenChoiceTopKRouter,
    )
    from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher

    # plain process groups and tensors, as torch.compile'd torchtitan runs; its default
    # backend wants the typed SPMD meshes its trainer sets up
    set_spmd_backend("plain")
    # its router asks CPU autocast for fp32, which CPU autocast declines with a warning
    # each call; the gate runs in fp32 either way
    warnings.filterwarnings("ignore", "In CPU autocast, but the target dtype", UserWarning)
    e, k = config.num_experts, config.top_k
    layer_cfg = MoE.Config(
        num_experts=e,
        load_balance_coeff=None,
        routed_experts=RoutedExperts.Config(
            inner_experts=GroupedExperts.Config(
                dim=config.hidden, hidden_dim=config.peer_ffn, num_experts=e
            ),
            token_dispatcher=AllToAllTokenDispatcher.Config(num_experts=e, top_k=k),
        ),
        router=TokenChoiceTopKRouter.Config(
            num_experts=e,
            top_k=k,
            score_func="softmax",
            route_norm=True,
            gate=Linear.Config(in_features=config.hidden, out_features=e),
        ),
    )
    torch.manual_seed(2)
    layer = layer_cfg.build().to(device)
    with torch.no_grad():
        layer.router.gate.weight.copy_(gate)
    inner = layer.routed_experts.inner_experts
    per_rank = e // world
    for name in ("w1_EFD", "w2_EDF", "w3_EFD"):
        full = torch.randn(e, *getattr(inner, name).shape[1:], device=device) * 0.02
        setattr(inner, name, nn.Parameter(full[rank * per_rank : (rank + 1) * per_rank]))
    if world > 1:
        mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("ep",))
        layer.routed_experts.token_dispatcher.wire_meshes(ep_mesh=mesh)
    return layer


def routing_agrees(plait: Any, peer: Any, x: torch.Tensor) -> float:
    """The fraction of this rank's tokens that both routers send to the same experts."""
    import torch

    with torch.no_grad():
        mine = plait.router(x).expert.sort(dim=-1).values
        theirs = peer.router(x.unsqueeze(0), None)[1].squeeze(0).sort(dim=-1).values
    return float((mine == theirs).all(dim=-1).float().mean())
