"""The schedule IR: an immutable action, and a schedule of one action list per pipeline rank.

A training run is a stream of windows, and a `Schedule` is the program of one window per
pipeline rank: `ranks[r]` lists rank r's actions (for example ``2F0``: forward of stage 2
on micro-batch 0) for window 0, written with the global micro-batch ids of window 0
(``0..m-1``). Window i runs the same program with every micro-batch id raised by ``i·m``
and every weight version by ``i·u`` (u = `updates_per_window`). An action whose
micro-batch id is negative belongs to a micro-batch of an earlier window: a steady-state
window of an asynchronous pipeline runs the backward of micro-batches forwarded in the
previous window. A finite run of n windows is this unbounded stream restricted to the
micro-batches ``0..n·m-1``, with versions below 0 meaning the initial weights (see
`plait.schedule.stream`). A synchronous schedule is a window that depends on no other: one
training step.

Data flows along a stage graph: `pipelines` lists the stages each pipeline visits in
order (one pipeline through every stage by default); micro-batch x runs through pipeline
``x mod len(pipelines)``. Several pipelines of equal length that cover every stage run
the same model (Chimera's two directions): a stage computes the model part at its
position in its pipeline (`parts`), and the stages of one part are replicas of it whose
gradients are summed before its update. Both the runtime and the simulator consume this
data; nothing here knows how an action is carried out.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from enum import StrEnum
from functools import cached_property
from itertools import pairwise
from typing import Any

__all__ = [
    "COMM_OPS",
    "COMPUTE_OPS",
    "P2P_OPS",
    "POLICIES",
    "WEIGHT_OPS",
    "Action",
    "Op",
    "Schedule",
    "new_action",
]


class Op(StrEnum):
    """What an action does. Stage numbers are global (virtual stages for interleaving)."""

    F = "F"  # forward of one micro-batch through one stage
    B = "B"  # full backward: input gradients and weight gradients together
    BI = "BI"  # backward for the stage inputs only (zero-bubble split)
    BW = "BW"  # backward for the weights only, after BI of the same micro-batch
    SEND_F = "SEND_F"  # send the activations of `stage` to its next stage
    RECV_F = "RECV_F"  # post the receive of the activations `stage` consumes
    SEND_B = "SEND_B"  # send the input gradients of `stage` to its previous stage
    RECV_B = "RECV_B"  # post the receive of the output gradients `stage` consumes
    # launch the data-parallel reduction of the gradients the next UPDATE of `stage` applies
    REDUCE = "REDUCE"
    # the optimizer step of `stage`: applies every gradient accumulated since its previous
    # UPDATE; `version` is the weight version it produces, `microbatch` the last one applied
    UPDATE = "UPDATE"
    # derived by `plait.schedule.stream`, never written by a generator: keep a copy of the
    # stage's current weights as `version`; make weights predicted for `version` from the
    # current ones; drop the copy of `version`
    STASH = "STASH"
    PREDICT = "PREDICT"
    FREE = "FREE"

    def __str__(self) -> str:
        return self.value


COMPUTE_OPS = frozenset({Op.F, Op.B, Op.BI, Op.BW})
P2P_OPS = frozenset({Op.SEND_F, Op.RECV_F, Op.SEND_B, Op.RECV_B})
COMM_OPS = P2P_OPS | {Op.REDUCE}
WEIGHT_OPS = frozenset({Op.STASH, Op.PREDICT, Op.FREE})

#: How the weight versions of a schedule's actions relate (checked by the validator):
#: sync - every action computes on the stage's current weights and no UPDATE of a stage
#:   falls between a micro-batch's forward and backward there (a flush per window);
#: stash - a forward uses the current weights, its backward the same (stashed) version
#:   (PipeDream);
#: vertical - every stage computes a micro-batch on the version its first stage used
#:   (PipeDream with vertical sync);
#: 2bw - one version per micro-batch across stages, at most two versions alive per stage
#:   (PipeDream-2BW);
#: predict - a micro-batch computes on weights predicted for the version its gradient is
#:   applied to (SpecTrain, XPipe).
POLICIES = ("sync", "stash", "vertical", "2bw", "predict")

_TEXT = re.compile(r"^(\d+)([A-Z_]+?)(-?\d+)(?:v(-?\d+))?$")


@dataclass(frozen=True, slots=True)
class Action:
    """One instruction of a rank's program.

    `stage` is the stage that owns the action: for sends the sending stage, for receives
    the receiving stage (as in torch.distributed.pipelining). `version` is the weight
    version a compute action uses (None: the stage's current weights), or the version an
    UPDATE produces. Prints as ``0F2`` or ``0F2v1``; `parse` reads that text back.
    """

    op: Op
    stage: int
    microbatch: int
    version: int | None = None

    def __post_init__(self) -> None:
        if self.stage < 0:
            raise ValueError(f"action {self.op}{self.stage},{self.microbatch} has a negative stage")

    def __str__(self) -> str:
        text = f"{self.stage}{self.op.value}{self.microbatch}"
        return text if self.version is None else f"{text}v{self.version}"

    @property
    def is_compute(self) -> bool:
        return self.op in COMPUTE_OPS

    @staticmethod
    def parse(text: str) -> Action:
        """The action that prints as `text` (``2F0``, ``1RECV_B3``, ``0B-1v2``)."""
        match = _TEXT.match(text.strip())
        if match is None:
            raise ValueError(f"{text!r} is not an action: write e.g. '2F0', '1SEND_B3' or '0B1v2'")
        stage, op, microbatch, version = match.groups()
        try:
            kind = Op(op)
        except ValueError:
            known = ", ".join(o.value for o in Op)
            raise ValueError(f"{text!r}: op {op!r} is not one of {known}") from None
        return Action(kind, int(stage), int(microbatch), None if version is None else int(version))

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"op": self.op.value, "stage": self.stage, "mb": self.microbatch}
        if self.version is not None:
            out["version"] = self.version
        return out

    @staticmethod
    def from_dict(data: dict[str, Any]) -> Action:
        unknown = set(data) - {"op", "stage", "mb", "version"}
        if unknown:
            raise ValueError(f"action {data} has unknown keys {sorted(unknown)}")
        try:
            op = Op(data["op"])
        except ValueError:
            known = ", ".join(o.value for o in Op)
            raise ValueError(f"action op {data['op']!r} is not one of {known}") from None
        version = data.get("version")
        return Action(
            op, int(data["stage"]), int(data["mb"]), None if version is None else int(version)
        )


def new_action(op: Op, stage: int, microbatch: int) -> Action:
    """`Action(op, stage, microbatch)` at half the cost, for generators whose stages are
    valid by construction: it sets the slots through their descriptors, as the frozen
    dataclass's __init__ does through object.__setattr__, without `__post_init__`'s check
    (a 64-stage ZB-V pipeline of 512 micro-batches makes 200 000)."""
    action = _new_action(Action)
    _set_op(action, op)
    _set_stage(action, stage)
    _set_microbatch(action, microbatch)
    _set_version(action, None)
    return action


_new_action = object.__new__
_set_op, _set_stage, _set_microbatch, _set_version = (
    getattr(Action, name).__set__ for name in ("op", "stage", "microbatch", "version")
)


@dataclass(frozen=True)
class Schedule:
    """One window of a training stream: `ranks[r]` is the program of pipeline rank r.

    `stage_to_rank[s]` places stage s; `num_stages` = pipeline ranks × chunks;
    `num_microbatches` (m) micro-batches enter per window; `policy` (one of `POLICIES`)
    says how the actions' weight versions relate; `pipelines` is the stage graph (empty:
    one pipeline through stages 0, 1, ..., in order).
    """

    kind: str
    num_ranks: int
    num_microbatches: int
    stage_to_rank: tuple[int, ...]
    ranks: tuple[tuple[Action, ...], ...]
    num_chunks: int = 1
    policy: str = "sync"
    pipelines: tuple[tuple[int, ...], ...] = ()

    def __post_init__(self) -> None:
        if len(self.ranks) != self.num_ranks:
            raise ValueError(f"schedule has {len(self.ranks)} programs for {self.num_ranks} ranks")
        if len(self.stage_to_rank) != self.num_ranks * self.num_chunks:
            raise ValueError(
                f"stage_to_rank has {len(self.stage_to_rank)} entries; expected "
                f"ranks × chunks = {self.num_ranks * self.num_chunks}"
            )
        bad = [r for r in self.stage_to_rank if not 0 <= r < self.num_ranks]
        if bad:
            raise ValueError(f"stage_to_rank names ranks {bad} outside 0..{self.num_ranks - 1}")
        if self.policy not in POLICIES:
            raise ValueError(f"policy={self.policy!r} is unknown; choose one of {POLICIES}")
        if self.num_microbatches < 1:
            raise ValueError(f"num_microbatches={self.num_microbatches}: a window needs >= 1")
        stages = [s for pipeline in self.pipelines for s in pipeline]
        if len(set(stages)) != len(stages) or not set(stages) <= set(range(self.num_stages)):
            raise ValueError(
                f"pipelines={self.pipelines}: each of stages 0..{self.num_stages - 1} may "
                "appear in at most one pipeline, once"
            )
        if any(not pipeline for pipeline in self.pipelines):
            raise ValueError(f"pipelines={self.pipelines}: a pipeline needs at least one stage")

    @property
    def num_stages(self) -> int:
        return len(self.stage_to_rank)

    def stages_of(self, rank: int) -> list[int]:
        """The stages placed on `rank`, in increasing order."""
        return [s for s, r in enumerate(self.stage_to_rank) if r == rank]

    # --------------------------------------------------------------- stage graph
    @cached_property
    def graph(self) -> tuple[tuple[tuple[int, ...], ...], tuple[int, ...], tuple[int, ...]]:
        """(pipelines, next stage per stage, previous stage per stage); -1 where none."""
        pipelines = self.pipelines or (tuple(range(self.num_stages)),)
        after, before = [-1] * self.num_stages, [-1] * self.num_stages
        for pipeline in pipelines:
            for a, b in pairwise(pipeline):
                after[a], before[b] = b, a
        return pipelines, tuple(after), tuple(before)

    def next_stage(self, stage: int) -> int | None:
        """The stage `stage` feeds, or None for a last stage."""
        after = self.graph[1][stage]
        return None if after < 0 else after

    def prev_stage(self, stage: int) -> int | None:
        """The stage that feeds `stage`, or None for a first stage."""
        before = self.graph[2][stage]
        return None if before < 0 else before

    def is_first(self, stage: int) -> bool:
        return self.graph[2][stage] < 0

    def is_last(self, stage: int) -> bool:
        return self.graph[1][stage] < 0

    def path(self, microbatch: int) -> tuple[int, ...]:
        """The stages micro-batch `microbatch` visits, in order."""
        pipelines = self.graph[0]
        return pipelines[microbatch % len(pipelines)]

    @cached_property
    def parts(self) -> tuple[int, ...]:
        """Per stage, the part of the model it computes (a partition has `num_parts`
        entries): its position in its pipeline when several pipelines of equal length
        cover every stage (replicas of one model); else the stage itself."""
        pipelines = self.graph[0]
        length = len(pipelines[0])
        if len(pipelines) == 1 or any(len(q) != length for q in pipelines):
            return tuple(range(self.num_stages))
        if length * len(pipelines) != self.num_stages:
            return tuple(range(self.num_stages))
        out = [0] * self.num_stages
        for pipeline in pipelines:
            for position, stage in enumerate(pipeline):
                out[stage] = position
        return tuple(out)

    @property
    def num_parts(self) -> int:
        """Distinct model parts the stages compute (`num_stages` unless replicated)."""
        return max(self.parts, default=-1) + 1

    def replicas(self, part: int) -> tuple[int, ...]:
        """The stages that compute model part `part`, in increasing order."""
        return tuple(s for s, k in enumerate(self.parts) if k == part)

    # ------------------------------------------------------------------ stream
    @cached_property
    def updates_per_window(self) -> int:
        """UPDATE actions per stage in one window (u); versions advance by u per window."""
        counts = [0] * self.num_stages
        for program in self.ranks:
            for a in program:
                if a.op is Op.UPDATE:
                    counts[a.stage] += 1
        return max(counts, default=0)

    @cached_property
    def reach(self) -> int:
        """How many windows after its own a micro-batch's last action can run: 0 for a
        window that depends on no other (a synchronous step)."""
        lowest = min((a.microbatch for p in self.ranks for a in p), default=0)
        return max(0, -(lowest // self.num_microbatches))

    def with_programs(self, ranks: list[list[Action]] | tuple[tuple[Action, ...], ...]) -> Schedule:
        """The same schedule with new per-rank programs (what a pass returns)."""
        return Schedule(
            kind=self.kind,
            num_ranks=self.num_ranks,
            num_microbatches=self.num_microbatches,
            stage_to_rank=self.stage_to_rank,
            ranks=tuple(tuple(p) for p in ranks),
            num_chunks=self.num_chunks,
            policy=self.policy,
            pipelines=self.pipelines,
        )

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "kind": self.kind,
            "policy": self.policy,
            "stages": self.num_ranks,
            "microbatches": self.num_microbatches,
            "chunks": self.num_chunks,
            "num_stages": self.num_stages,
            "stage_to_rank": list(self.stage_to_rank),
            "ranks": [[a.to_dict() for a in program] for program in self.ranks],
        }
        if self.pipelines:
            out["pipelines"] = [list(p) for p in self.pipelines]
        return out

    def to_json(self, *, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @staticmethod
    def from_dict(data: dict[str, Any]) -> Schedule:
        required = {"kind", "stages", "microbatches", "chunks", "stage_to_rank", "ranks"}
        missing = required - set(data)
        if missing:
            raise ValueError(f"schedule JSON lacks keys {sorted(missing)}")
        unknown = set(data) - required - {"num_stages", "policy", "pipelines"}
        if unknown:
            raise ValueError(f"schedule JSON has unknown keys {sorted(unknown)}")
        schedule = Schedule(
            kind=str(data["kind"]),
            num_ranks=int(data["stages"]),
            num_microbatches=int(data["microbatches"]),
            stage_to_rank=tuple(int(r) for r in data["stage_to_rank"]),
            ranks=tuple(tuple(Action.from_dict(a) for a in p) for p in data["ranks"]),
            num_chunks=int(data["chunks"]),
            policy=str(data.get("policy", "sync")),
            pipelines=tuple(tuple(int(s) for s in p) for p in data.get("pipelines", ())),
        )
        if "num_stages" in data and int(data["num_stages"]) != schedule.num_stages:
            raise ValueError(
                f"num_stages={data['num_stages']} disagrees with stage_to_rank "
                f"({schedule.num_stages} entries)"
            )
        return schedule

    @staticmethod
    def from_json(text: str) -> Schedule:
        return Schedule.from_dict(json.loads(text))
