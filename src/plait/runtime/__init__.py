"""Executing one rank's pipeline program on torch.distributed."""

from plait.runtime.executor import ActionRecord, PipelineExecutor, StepResult
from plait.runtime.stages import local_stages, split_microbatches

__all__ = ["ActionRecord", "PipelineExecutor", "StepResult", "local_stages", "split_microbatches"]
