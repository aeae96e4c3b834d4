"""The process groups a pipeline's messages travel on: one per directed pair of its ranks.

Why not the pipeline's one process group: NCCL runs a rank's point-to-point operations of
one communicator in the order they were issued, so a receive posted early blocks the sends
issued after it; two ranks that each post a receive from the other before sending to it
then wait forever (`plait.schedule.lower` has the example and the proof). A group per
directed pair makes each channel a first-in, first-out queue of its own, which is what the
schedule validator assumes. Creating a group is collective over the whole world (every
rank makes every group, in the same order: torch names groups by how many a rank holds),
so every pipeline's channels are made together, by whoever builds the pipelines.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch.distributed as dist

from plait.schedule import P2P_OPS, Op, Schedule
from plait.schedule.lower import channel

__all__ = ["Channels", "build_channels", "channel_pairs", "release"]


@dataclass(frozen=True)
class Channels:
    """This rank's channels: (sending, receiving pipeline rank) -> (process group, the
    global rank of the other end); `ranks` are the pipeline's global ranks."""

    groups: dict[tuple[int, int], dist.ProcessGroup]
    ranks: tuple[int, ...]

    def group(self, src: int, dst: int) -> dist.ProcessGroup:
        return self.groups[(src, dst)]

    def global_rank(self, pipeline_rank: int) -> int:
        return self.ranks[pipeline_rank]


def channel_pairs(schedule: Schedule) -> list[tuple[int, int]]:
    """The directed pairs of pipeline ranks that exchange messages in `schedule`."""
    pairs = set()
    place = schedule.stage_to_rank
    for rank, program in enumerate(schedule.ranks):
        for a in program:
            if a.op not in P2P_OPS:
                continue
            forward = a.op is Op.SEND_F or a.op is Op.RECV_B
            other = schedule.next_stage(a.stage) if forward else schedule.prev_stage(a.stage)
            if other is None:
                continue
            sending = a.op is Op.SEND_F or a.op is Op.SEND_B
            pairs.add(channel(rank, place[other]) if sending else channel(place[other], rank))
    return sorted(pairs)


def build_channels(pipelines: Sequence[tuple[Schedule, Sequence[int]]]) -> Channels | None:
    """Make the channel groups of every pipeline (its schedule and its global ranks by
    pipeline rank) on every rank, in one order; return this rank's (None when it is in
    none of them). A collective over the whole world. Made afresh for every engine, unlike
    the meshes (`plait.mesh.kept`): a receive that an engine posted and abandoned (a timed
    out step) would take the next engine's messages on a shared channel."""
    me = dist.get_rank()
    mine: Channels | None = None
    for schedule, ranks in pipelines:
        groups = {}
        for src, dst in channel_pairs(schedule):
            group = dist.new_group([ranks[src], ranks[dst]])
            if me in (ranks[src], ranks[dst]):
                groups[(src, dst)] = group
        if me in ranks:
            mine = Channels(groups, tuple(ranks))
    return mine


def release(channels: Channels) -> None:
    """Destroy this rank's channel groups: torch keeps a group until the default group is
    destroyed, and each gloo group's connection loop wakes every 10 ms; a process building
    engines one after another (a 4-worker sweep of 46) had its later plans run 50-70%
    slower for it. Collective: every rank calls it, once no message is in flight."""
    dist.barrier()  # no peer is still reading a message this rank sent
    for group in channels.groups.values():
        dist.destroy_process_group(group)
