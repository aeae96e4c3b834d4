"""The planner's per-stage recomputation: where the best plan recomputes every stage, each
stage recomputes only what its rank's memory needs (1F1B's first stages hold the most
micro-batches), on the same cut, and the plan wins when that is faster."""

from __future__ import annotations

import dataclasses

from plait.cluster import Cluster, Device, Link, NodeGroup
from plait.cost import StageCost
from plait.plan import SearchSpace, describe, gpt_spec, search
from plait.plan.lighter import LEVELS
from plait.sim import SimPlan, build_schedule, simulate

GIB = 2**30
MARGIN = 0.05
_LINK = Link(latency_s=1e-6, bandwidth_Bps=100e9)
# a 3.2B-parameter GPT without ZeRO on four 18 GiB devices: only a 4-stage pipeline holds
# its state, and its first stages cannot keep every micro-batch's activations
_DEVICE = Device(name="gpu", peak_flops={"bf16": 100e12}, efficiency=0.5, memory_bytes=18 * GIB)
CLUSTER = Cluster(
    name="four",
    groups=(NodeGroup(device=_DEVICE, devices_per_node=4, intra_node=_LINK, num_nodes=1),),
    inter_node=_LINK,
)
MODEL = gpt_spec(num_layers=16, hidden=4096, num_heads=1, seq_len=2048, vocab_size=32000)
# without offload: keeping the optimizer state on the host beats recomputing here
SPACE = SearchSpace(schedules=("1f1b",), zero_stages=(0,), micro_batch_sizes=(2,),
                    sequence_parallel=(False,), offload=False)  # fmt: skip


def _peaks(plan: SimPlan, sizes: tuple[int, ...]) -> list[float]:
    blocks, stages, first = MODEL.blocks_for(plan), [], 0
    for n in sizes:
        stages.append(StageCost(tuple(blocks[first : first + n])))
        first += n
    result = simulate(build_schedule(plan), stages, CLUSTER, plan)
    return [r.memory.total / r.capacity_bytes for r in result.ranks]


def test_the_first_stages_recompute_and_the_last_do_not() -> None:
    found = search(MODEL, CLUSTER, global_batch=16, space=SPACE, memory_margin=MARGIN)
    best = found.best
    modes = best.plan.recompute_stages
    assert modes is not None and "none" in modes and modes[0] != "none", describe(best.plan)
    # activations held fall along 1F1B's ranks: so does what each stage must recompute
    assert [LEVELS.index(m) for m in modes] == sorted((LEVELS.index(m) for m in modes),
                                                      reverse=True)  # fmt: skip
    uniform = [r for r in found.ranked if r.plan.recompute_stages is None]
    assert best.step_time_s < min(r.step_time_s for r in uniform if r.plan.recompute != "none")
    # every rank fits, and no stage could recompute less: one level less overflows its rank
    assert max(_peaks(best.plan, best.sizes)) <= 1 - MARGIN
    for stage, mode in enumerate(modes):
        if mode == "none":
            continue
        lower = list(modes)
        lower[stage] = LEVELS[LEVELS.index(mode) - 1]
        less = dataclasses.replace(best.plan, recompute_stages=tuple(lower))
        assert _peaks(less, best.sizes)[stage] > 1 - MARGIN, (stage, lower)


def test_with_room_to_spare_nothing_is_recomputed() -> None:
    roomy = dataclasses.replace(_DEVICE, memory_bytes=28 * GIB)
    cluster = dataclasses.replace(
        CLUSTER, groups=(dataclasses.replace(CLUSTER.groups[0], device=roomy),)
    )
    best = search(MODEL, cluster, global_batch=16, space=SPACE).best
    assert best.plan.recompute == "none" and best.plan.recompute_stages is None
