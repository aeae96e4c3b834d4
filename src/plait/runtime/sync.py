"""The protocol through which the pipeline executor tells data parallelism about backward."""

from __future__ import annotations

from typing import Protocol

__all__ = ["GradSync"]


class GradSync(Protocol):
    """Called by the executor around every backward action (B, BI, BW) of a stage, and at
    the stage's REDUCE; the optimizer step calls `finish` and `zero_grad`.

    `last` is True for the stage's final weight-gradient action before its next REDUCE
    (after which the stage's gradients for its next update are complete and may be
    reduced while the rank goes on with other work).
    """

    def before_backward(self, stage: int, *, last: bool) -> None: ...

    def after_backward(self, stage: int, *, last: bool) -> None: ...

    def reduce(self, stage: int) -> None:
        """Launch whatever of the stage's reduction has not started (a REDUCE action)."""
        ...

    def zero_grad(self, stage: int | None = None) -> None:
        """Clear the gradients it reduces, of one stage or of all, before they accumulate."""
        ...

    def finish(self, stage: int | None = None) -> None:
        """Wait for the reductions of one stage or of all; gradients are then final."""
        ...
