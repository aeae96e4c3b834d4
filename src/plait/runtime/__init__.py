"""Executing one rank's pipeline program on torch.distributed."""

from plait.runtime.executor import ActionRecord, PipelineExecutor, StepResult
from plait.runtime.stages import local_stages, split_microbatches
from plait.wait import DEFAULT_TIMEOUT_S, PipelineTimeout

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "ActionRecord",
    "PipelineExecutor",
    "PipelineTimeout",
    "StepResult",
    "local_stages",
    "split_microbatches",
]
