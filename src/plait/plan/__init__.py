"""Planning: partition blocks into balanced stages (the layout search builds on this)."""

from plait.plan.partition import Partition, partition, partition_blocks

__all__ = ["Partition", "partition", "partition_blocks"]
