"""The schedule IR: an immutable action, and a schedule of one action list per pipeline rank.

A training step is a small program per worker. `Action` is one instruction (for example
``2F0``: forward of stage 2 on micro-batch 0); `Schedule` is one list of them per pipeline
rank plus the placement of (virtual) stages on ranks. Both the runtime and the simulator
consume this data; nothing here knows how an action is carried out.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

__all__ = ["COMM_OPS", "COMPUTE_OPS", "Action", "Op", "Schedule"]


class Op(StrEnum):
    """What an action does. Stage numbers are global (virtual stages for interleaving)."""

    F = "F"  # forward of one micro-batch through one stage
    B = "B"  # full backward: input gradients and weight gradients together
    BI = "BI"  # backward for the stage inputs only (zero-bubble split)
    BW = "BW"  # backward for the weights only, after BI of the same micro-batch
    SEND_F = "SEND_F"  # send the activations of `stage` to stage + 1
    RECV_F = "RECV_F"  # post the receive of the activations `stage` consumes
    SEND_B = "SEND_B"  # send the input gradients of `stage` to stage - 1
    RECV_B = "RECV_B"  # post the receive of the output gradients `stage` consumes

    def __str__(self) -> str:
        return self.value


COMPUTE_OPS = frozenset({Op.F, Op.B, Op.BI, Op.BW})
COMM_OPS = frozenset({Op.SEND_F, Op.RECV_F, Op.SEND_B, Op.RECV_B})


@dataclass(frozen=True, slots=True)
class Action:
    """One instruction of a rank's program.

    `stage` is the stage that owns the action: for sends the sending stage, for receives
    the receiving stage (as in torch.distributed.pipelining). `version` is the weight
    version an asynchronous schedule computes with; synchronous schedules leave it None.
    """

    op: Op
    stage: int
    microbatch: int
    version: int | None = None

    def __post_init__(self) -> None:
        if self.stage < 0 or self.microbatch < 0:
            raise ValueError(f"action {self.op}{self.stage},{self.microbatch} has a negative index")

    def __str__(self) -> str:
        text = f"{self.stage}{self.op.value}{self.microbatch}"
        return text if self.version is None else f"{text}v{self.version}"

    @property
    def is_compute(self) -> bool:
        return self.op in COMPUTE_OPS

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


@dataclass(frozen=True)
class Schedule:
    """One training step (or, for asynchronous schedules, one steady-state window).

    `ranks[r]` is the program of pipeline rank r. `stage_to_rank[s]` places stage s;
    `num_stages` = pipeline ranks × chunks.
    """

    kind: str
    num_ranks: int
    num_microbatches: int
    stage_to_rank: tuple[int, ...]
    ranks: tuple[tuple[Action, ...], ...]
    num_chunks: int = 1
    meta: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

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

    @property
    def num_stages(self) -> int:
        return len(self.stage_to_rank)

    def stages_of(self, rank: int) -> list[int]:
        """The stages placed on `rank`, in increasing order."""
        return [s for s, r in enumerate(self.stage_to_rank) if r == rank]

    def with_programs(self, ranks: list[list[Action]] | tuple[tuple[Action, ...], ...]) -> Schedule:
        """The same schedule with new per-rank programs (what a pass returns)."""
        return Schedule(
            kind=self.kind,
            num_ranks=self.num_ranks,
            num_microbatches=self.num_microbatches,
            stage_to_rank=self.stage_to_rank,
            ranks=tuple(tuple(p) for p in ranks),
            num_chunks=self.num_chunks,
            meta=dict(self.meta),
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "stages": self.num_ranks,
            "microbatches": self.num_microbatches,
            "chunks": self.num_chunks,
            "num_stages": self.num_stages,
            "stage_to_rank": list(self.stage_to_rank),
            "ranks": [[a.to_dict() for a in program] for program in self.ranks],
        }

    def to_json(self, *, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @staticmethod
    def from_dict(data: dict[str, Any]) -> Schedule:
        required = {"kind", "stages", "microbatches", "chunks", "stage_to_rank", "ranks"}
        missing = required - set(data)
        if missing:
            raise ValueError(f"schedule JSON lacks keys {sorted(missing)}")
        schedule = Schedule(
            kind=str(data["kind"]),
            num_ranks=int(data["stages"]),
            num_microbatches=int(data["microbatches"]),
            stage_to_rank=tuple(int(r) for r in data["stage_to_rank"]),
            ranks=tuple(tuple(Action.from_dict(a) for a in p) for p in data["ranks"]),
            num_chunks=int(data["chunks"]),
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
