"""Schedules as data: the IR, the stream of windows, generators and their registry,
lowering passes, the validator and the replayer."""

from plait.schedule.asynchronous import (
    pipedream,
    pipedream_2bw,
    pipedream_vertical,
    spectrain,
    xpipe,
)
from plait.schedule.generators import (
    gpipe,
    interleaved_1f1b,
    one_f_one_b,
    zero_bubble_h1,
    zero_bubble_h2,
)
from plait.schedule.grid import format_grid, format_program
from plait.schedule.ir import (
    COMM_OPS,
    COMPUTE_OPS,
    P2P_OPS,
    POLICIES,
    WEIGHT_OPS,
    Action,
    Op,
    Schedule,
)
from plait.schedule.passes import (
    add_communication,
    add_reductions,
    completing_backwards,
    compute_only,
)
from plait.schedule.registry import KINDS, ScheduleKind, build, kind_names, schedule_kind
from plait.schedule.replay import Event, Replay, replay, unit_duration
from plait.schedule.stream import RankStream, Unrolled, unroll
from plait.schedule.validate import ScheduleError, ValidationReport, validate, window_ends
from plait.schedule.versions import VersionError, WeightPlanner
from plait.schedule.vshape import chimera, v_placement, zero_bubble_v

__all__ = [
    "COMM_OPS",
    "COMPUTE_OPS",
    "KINDS",
    "P2P_OPS",
    "POLICIES",
    "WEIGHT_OPS",
    "Action",
    "Event",
    "Op",
    "RankStream",
    "Replay",
    "Schedule",
    "ScheduleError",
    "ScheduleKind",
    "Unrolled",
    "ValidationReport",
    "VersionError",
    "WeightPlanner",
    "add_communication",
    "add_reductions",
    "build",
    "chimera",
    "completing_backwards",
    "compute_only",
    "format_grid",
    "format_program",
    "gpipe",
    "interleaved_1f1b",
    "kind_names",
    "one_f_one_b",
    "pipedream",
    "pipedream_2bw",
    "pipedream_vertical",
    "replay",
    "schedule_kind",
    "spectrain",
    "unit_duration",
    "unroll",
    "v_placement",
    "validate",
    "window_ends",
    "xpipe",
    "zero_bubble_h1",
    "zero_bubble_h2",
    "zero_bubble_v",
]
