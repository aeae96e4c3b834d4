"""torch.profiler over a window of training steps (`profile_steps = "A:B"`), one trace per rank.

While it records, the executor labels each action it runs (`record_function("PP:2F0")`),
so the exported Chrome trace (`profile-rank<r>.json`, open it in https://ui.perfetto.dev)
shows the schedule's actions around the operators they ran.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from plait.device import profiler_activities

__all__ = ["StepProfiler", "parse_steps"]


def parse_steps(text: str) -> tuple[int, int]:
    """`"A:B"` as (A, B): steps A to B-1."""
    first, sep, last = text.partition(":")
    if not sep or not first.strip().isdigit() or not last.strip().isdigit():
        raise ValueError(f"profile_steps={text!r} must read A:B (steps A to B-1), e.g. '5:7'")
    return int(first), int(last)


class StepProfiler:
    """Call `tick(step)` before each step and `close()` after the loop."""

    def __init__(
        self, steps: str | None, run_dir: Path, rank: int, device: torch.device | None = None
    ) -> None:
        self.window = parse_steps(steps) if steps else None
        self.device = device or torch.device("cpu")
        self.path = run_dir / f"profile-rank{rank}.json"
        self.prof: Any = None

    def tick(self, step: int) -> None:
        if self.window is None:
            return
        first, last = self.window
        if step == first and self.prof is None:
            activities = profiler_activities(self.device)
            self.prof = torch.profiler.profile(activities=activities, record_shapes=False)
            self.prof.__enter__()
        elif step == last:
            self.close()

    def close(self) -> None:
        if self.prof is None:
            return
        prof, self.prof = self.prof, None
        prof.__exit__(None, None, None)
        prof.export_chrome_trace(str(self.path))
