"""The simulator: replay a schedule on the cost model and predict one training step."""

from plait.sim.plan import RANK_ORDERS, SimPlan
from plait.sim.replica import ReplicaRun, simulate_replica
from plait.sim.result import MemoryOverflow, MemoryUse, RankReport, SimResult, TimelineEvent
from plait.sim.step import build_schedule, simulate

__all__ = [
    "RANK_ORDERS",
    "MemoryOverflow",
    "MemoryUse",
    "RankReport",
    "ReplicaRun",
    "SimPlan",
    "SimResult",
    "TimelineEvent",
    "build_schedule",
    "simulate",
    "simulate_replica",
]
