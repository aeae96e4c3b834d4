"""plait: train one PyTorch model on many workers, with a plan it predicts before it runs.

`plait.parallelize(model, plan, optimizer_factory, loss_fn)` is the training API; it is
imported on first use so that the pure packages (schedule, cost, sim, plan) load without
torch.
"""

from typing import Any

__version__ = "0.1.0"
__all__ = ["Engine", "ParallelPlan", "parallelize"]


def __getattr__(name: str) -> Any:
    if name == "parallelize":
        from plait.train.parallelize import parallelize

        return parallelize
    if name == "Engine":
        from plait.train.engine import Engine

        return Engine
    if name == "ParallelPlan":
        from plait.config import ParallelPlan

        return ParallelPlan
    raise AttributeError(f"module 'plait' has no attribute {name!r}")
