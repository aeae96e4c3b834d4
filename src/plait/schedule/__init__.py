"""Schedules as data: the IR, generators, lowering passes, the validator and the replayer."""

from plait.schedule.generators import (
    GENERATORS,
    build,
    gpipe,
    interleaved_1f1b,
    one_f_one_b,
    zero_bubble_h1,
)
from plait.schedule.grid import format_grid, format_program
from plait.schedule.ir import COMM_OPS, COMPUTE_OPS, Action, Op, Schedule
from plait.schedule.passes import add_communication, compute_only
from plait.schedule.replay import Event, Replay, replay, unit_duration
from plait.schedule.validate import ScheduleError, ValidationReport, validate

__all__ = [
    "COMM_OPS",
    "COMPUTE_OPS",
    "GENERATORS",
    "Action",
    "Event",
    "Op",
    "Replay",
    "Schedule",
    "ScheduleError",
    "ValidationReport",
    "add_communication",
    "build",
    "compute_only",
    "format_grid",
    "format_program",
    "gpipe",
    "interleaved_1f1b",
    "one_f_one_b",
    "replay",
    "unit_duration",
    "validate",
    "zero_bubble_h1",
]
