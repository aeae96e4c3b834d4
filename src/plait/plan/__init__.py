"""Planning: partition blocks into balanced stages, search layouts, explain the choice."""

from plait.plan.partition import MemoryShortfall, Partition, partition, partition_blocks
from plait.plan.search import NoFeasiblePlan, PlanSearch, RankedPlan, Rejection, describe, search
from plait.plan.space import (
    ModelSpec,
    SearchSpace,
    candidates,
    degrees,
    expert_degrees,
    gpt_spec,
    moe_spec,
    scaled_spec,
)

__all__ = [
    "MemoryShortfall",
    "ModelSpec",
    "NoFeasiblePlan",
    "Partition",
    "PlanSearch",
    "RankedPlan",
    "Rejection",
    "SearchSpace",
    "candidates",
    "degrees",
    "describe",
    "expert_degrees",
    "gpt_spec",
    "moe_spec",
    "partition",
    "partition_blocks",
    "scaled_spec",
    "search",
]
