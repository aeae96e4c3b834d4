"""The protocol through which the pipeline executor tells data parallelism about backward."""

from __future__ import annotations

from typing import Protocol

__all__ = ["GradSync"]


class GradSync(Protocol):
    """Called by the executor around every backward action (B, BI, BW) of a stage.

    `last` is True for the stage's final weight-gradient action of the step (its last B
    or BW in the program), after which the stage's gradients are complete and may be
    reduced while the rank goes on with other work.
    """

    def before_backward(self, stage: int, *, last: bool) -> None: ...

    def after_backward(self, stage: int, *, last: bool) -> None: ...

    def zero_grad(self) -> None:
        """Clear the gradients of every parameter it reduces, before a step."""
        ...

    def finish(self) -> None:
        """Wait for every reduction launched this step; gradients are then final."""
        ...
