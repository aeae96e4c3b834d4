"""The host's share of a step: seconds a process takes to issue each compute action.

A process issues a block's forward or backward as a sequence of operators (Python, the
dispatcher, kernel launches); the device runs them asynchronously, so an action takes the
longer of its device time and its issue time (`plait.sim.replica`). `Device.dispatch_s`
is the issue time of one block's forward or backward, measured by `plait profile` or set
per device in a cluster file; 0 leaves every action device-bound. When one process issues
every pipeline stage's actions (torchgpipe's runner, `SimPlan.single_process`), their
issue times share one host timeline: `host_window_s` is their sum over one window.
Where the thread that computes also posts the pipeline's messages (gloo on CPU workers),
`posting_times` is what each action adds for them (`Device.message_s`).
"""

from __future__ import annotations

from collections.abc import Sequence

from plait.cluster import Device
from plait.cost import StageCost
from plait.schedule import Op, Schedule

__all__ = ["host_window_s", "issue_times", "posting_times"]


def issue_times(
    stages: Sequence[StageCost], devices: Sequence[Device], recompute: Sequence[str]
) -> dict[Op, list[float]]:
    """Host seconds to issue each compute action of each stage on its device: one
    `dispatch_s` per block per forward and per backward, a full recomputation's forward
    again before the backward, a split backward's launches shared equally by its halves
    (a selective recomputation's few operators are not counted)."""
    forward = [len(st.blocks) * dev.dispatch_s for st, dev in zip(stages, devices, strict=True)]
    redo = [f if rc == "full" else 0.0 for f, rc in zip(forward, recompute, strict=True)]
    return {
        Op.F: forward,
        Op.B: [f + r for f, r in zip(forward, redo, strict=True)],
        Op.BI: [f / 2 + r for f, r in zip(forward, redo, strict=True)],
        Op.BW: [f / 2 for f in forward],
    }


def host_window_s(schedule: Schedule, issue: dict[Op, list[float]]) -> float:
    """Host seconds to issue one window's compute actions of every pipeline rank: the
    least a step takes when one process issues them all."""
    return sum(issue[a.op][a.stage] for program in schedule.ranks for a in program if a.op in issue)


def posting_times(schedule: Schedule, devices: Sequence[Device]) -> list[float]:
    """Per stage, the host seconds each of its forwards (and backwards) spends posting the
    messages of its boundaries that cross ranks (`Device.message_s` of the stage's device
    `devices[s]`): a forward receives its input and sends its output, a backward (its input
    half when split) receives the output's gradient and sends the input's."""
    place, out = schedule.stage_to_rank, []
    for i, device in enumerate(devices):
        peers = (schedule.prev_stage(i), schedule.next_stage(i))
        crossing = sum(1 for j in peers if j is not None and place[j] != place[i])
        out.append(crossing * device.message_s)
    return out
