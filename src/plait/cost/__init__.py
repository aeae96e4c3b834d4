"""The analytic cost model: compute, communication and memory of blocks and stages."""

from plait.cost.blocks import (
    RECOMPUTE_MODES,
    BlockCost,
    Recompute,
    StageCost,
    StageTimes,
    check_recompute,
    stage_costs,
)
from plait.cost.comm import (
    COLLECTIVE_KINDS,
    Collective,
    CollectiveKind,
    all_gather_time,
    all_reduce_time,
    all_to_all_time,
    collective_time,
    dp_sync_time,
    group_collective_time,
    p2p_time,
    reduce_scatter_time,
    ring_all_reduce_time,
    tree_all_reduce_time,
)
from plait.cost.memory import ModelState, Optimizer, model_state_bytes, optimizer_step_time
from plait.cost.transformer import (
    TransformerShape,
    layer_activation_bytes,
    transformer_block_costs,
)

__all__ = [
    "COLLECTIVE_KINDS",
    "RECOMPUTE_MODES",
    "BlockCost",
    "Collective",
    "CollectiveKind",
    "ModelState",
    "Optimizer",
    "Recompute",
    "StageCost",
    "StageTimes",
    "TransformerShape",
    "all_gather_time",
    "all_reduce_time",
    "all_to_all_time",
    "check_recompute",
    "collective_time",
    "dp_sync_time",
    "group_collective_time",
    "layer_activation_bytes",
    "model_state_bytes",
    "optimizer_step_time",
    "p2p_time",
    "reduce_scatter_time",
    "ring_all_reduce_time",
    "stage_costs",
    "transformer_block_costs",
    "tree_all_reduce_time",
]
