"""How the sim-accuracy bench predicts a plan: measured blocks, cut into the plan's stages,
simulated on a local node of pinned workers (see `plait.bench.sim_accuracy`)."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from plait.bench.accuracy_plans import AccuracyConfig, PlanRun

__all__ = ["device", "fit_efficiency", "predict"]


def device(cal: dict[str, Any]) -> Any:
    """One core as the calibration `cal` measured it."""
    from plait.profile import measured_device

    return measured_device(name="cpu core", flops=cal["flops"],
                           memory_bytes=1 << 40,  # this bench checks time, not memory
                           memory_bandwidth_Bps=cal["memory_bandwidth_Bps"])  # fmt: skip


def _stage_costs(cal: dict[str, Any], run: PlanRun, schedule: Any) -> list[Any]:
    """The measured blocks cut into the plan's stages, costed as the runtime runs them: a
    schedule with BI/BW pays the split backward's halves, except on the first stage (its
    input needs no gradient: the runtime runs its whole backward as BW); each stage starts
    with the overheads of posting the messages of its boundaries that cross ranks."""
    from plait.cost import BlockCost, StageCost
    from plait.profile import BlockProfile
    from plait.schedule import Op

    split = any(a.op is Op.BI for program in schedule.ranks for a in program)
    blocks = [BlockProfile.from_dict(b) for b in cal["blocks"]]
    core, place, stages, start = device(cal), schedule.stage_to_rank, [], 0
    send, recv = cal["message_overheads"]
    for s, size in enumerate(run.sizes):
        part = blocks[start : start + size]
        start += size
        if split and s == 0:
            part = [replace(b, backward_input_s=0.0, backward_weight_s=b.backward_s) for b in part]
        after = s + 1 < len(place) and place[s + 1] != place[s]
        before = s > 0 and place[s - 1] != place[s]
        messages = BlockCost.from_seconds("messages", device=core, dtype="fp32",
                                          forward_s=send * after + recv * before,
                                          backward_input_s=send * before + recv * after,
                                          backward_weight_s=0.0)  # fmt: skip
        costs = [b.to_cost(core, "fp32", split=split) for b in part]
        stages.append(StageCost((messages, *costs)))
    return stages


def _simulate(c: AccuracyConfig, run: PlanRun, cal: dict[str, Any], cores: int) -> Any:
    """Simulate `run` on one node of `run.pp` workers pinned to `cores` cores, as
    `plait.mesh.init_worker` pins them (time-shared when they outnumber the cores)."""
    from plait.cluster import Cluster, Link, NodeGroup
    from plait.sim import SimPlan, build_schedule, simulate

    link = Link(**cal["link"])
    group = NodeGroup(device=device(cal), devices_per_node=run.pp, intra_node=link,
                      processors=cores if run.pp > cores else None,
                      sharing_efficiency=cal.get("sharing_efficiency", 1.0))  # fmt: skip
    cluster = Cluster(name=f"local-cpu ({run.pp} workers)", groups=(group,), inter_node=link)
    plan = SimPlan(pp=run.pp, schedule=run.schedule, microbatches=run.num_microbatches,
                   micro_batch_size=c.micro_batch_size, chunks=run.num_chunks,
                   dtype="fp32", seq_len=c.seq_len)  # fmt: skip
    schedule = build_schedule(plan)
    return simulate(schedule, _stage_costs(cal, run, schedule), cluster, plan)


def predict(config: AccuracyConfig, run: PlanRun, cal: dict[str, Any], cores: int) -> PlanRun:
    """`run` with its prediction."""
    from plait.trace import spans_from_timeline

    result = _simulate(config, run, cal, cores)
    spans = spans_from_timeline(result.timeline)
    return replace(run, predicted_s=result.step_time_s, predicted_bubble=result.bubble_fraction,
                   predicted=tuple(spans))  # fmt: skip


def fit_efficiency(config: AccuracyConfig, run: PlanRun, cal: dict[str, Any], cores: int) -> float:
    """The sharing efficiency (`NodeGroup.sharing_efficiency`) under which the simulator
    reproduces the measured reference `run` (bisection: predictions fall as it rises)."""
    from plait.schedule.sharing import fit_efficiency as solve

    def predicted(efficiency: float) -> float:
        return predict(config, run, cal | {"sharing_efficiency": efficiency}, cores).predicted_s

    return solve(predicted, run.measured_s)
