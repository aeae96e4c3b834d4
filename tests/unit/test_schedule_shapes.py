"""ZB-H2, ZB-V and Chimera against their papers' closed forms and torch's ZB-V order.

The timelines here come from a list emulator written in this file (every rank runs its
compute actions in program order, each as soon as its inputs exist), not from plait's
replay; plait's validator must agree with it.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from types import SimpleNamespace

import pytest

from plait.schedule import Action, Op, Schedule, build, compute_only, validate

Cost = Callable[[Op], int]


def unit(op: Op) -> int:
    return 0 if op is Op.UPDATE else 1  # F = BI = BW = B = 1 slot


def emulate(schedule: Schedule, cost: Cost = unit) -> list[tuple[int, int]]:
    """Per rank, (first start, last end) of its compute, each action started as soon as the
    rank is free and its data exists (activations from the previous stage of the path,
    gradients from the next)."""
    programs = [[a for a in p if a.is_compute] for p in compute_only(schedule).ranks]
    before: dict[int, int] = {}
    after: dict[int, int] = {}
    for q in schedule.pipelines or (tuple(range(schedule.num_stages)),):
        for a, b in itertools.pairwise(q):
            before[b], after[a] = a, b
    end: dict[tuple[str, int, int], int] = {}
    pc, clock = [0] * len(programs), [0] * len(programs)
    spans: list[list[int]] = [[-1, 0] for _ in programs]
    while any(pc[r] < len(p) for r, p in enumerate(programs)):
        moved = False
        for r, program in enumerate(programs):
            while pc[r] < len(program):
                a = program[pc[r]]
                x = a.microbatch
                if a.op is Op.F:
                    needs = [("F", before[a.stage], x)] if a.stage in before else []
                elif a.op is Op.BW:
                    needs = [("BI", a.stage, x)]
                else:
                    needs = [("F", a.stage, x)]
                    needs += [("BI", after[a.stage], x)] if a.stage in after else []
                if any(n not in end for n in needs):
                    break
                start = max([clock[r], *(end[n] for n in needs)])
                clock[r] = start + cost(a.op)
                key = "BI" if a.op in (Op.B, Op.BI) else a.op.value
                end[(key, a.stage, x)] = clock[r]
                if spans[r][0] < 0:
                    spans[r][0] = start
                spans[r][1] = clock[r]
                pc[r] += 1
                moved = True
        assert moved, "the emulated schedule deadlocks"
    return [(s, e) for s, e in spans]


def busy(schedule: Schedule, rank: int, cost: Cost = unit) -> int:
    return sum(cost(a.op) for a in schedule.ranks[rank] if a.is_compute)


@pytest.mark.parametrize("p", [2, 3, 4, 5])
def test_zb_h2_has_no_bubble_inside_any_rank_span(p: int) -> None:
    """Qi et al. 2024, section 2.2: ZB-H2's bubble is (p-1)(T_F + T_B - 2T_W), zero when
    F = B = W = 1, with up to 2p - 1 micro-batches in flight once m >= 2p - 1. Every rank
    is busy from its first forward (at time r) to its end: a parallelogram; after the
    flush the step takes 3m + p - 1 (rank p-1 waits p-1 forwards, then has 3m to do)."""
    for m in (2 * p - 1, 2 * p, 3 * p + 1):
        schedule = build("zb-h2", p, m)
        spans = emulate(schedule)
        for r, (start, end) in enumerate(spans):
            bubble = (p - 1) * (1 + 1 - 2 * 1)
            assert start == r
            assert end - start - busy(schedule, r) == bubble
        assert max(end for _, end in spans) == 3 * m + p - 1
        report = validate(schedule)
        assert report.makespan == 3 * m + p - 1  # plait's unit costs: F = BI = BW = 1
        assert max(report.peak_inflight) == 2 * p - 1


def test_zb_h2_holds_more_than_zb_h1_and_ends_no_later() -> None:
    for p, m in [(3, 6), (4, 9)]:
        h1, h2 = validate(build("zb-h1", p, m)), validate(build("zb-h2", p, m))
        assert max(h1.peak_inflight) == p and h2.makespan <= h1.makespan


def _torch_zbv_programs(p: int, m: int) -> list[list[Action]]:
    """The per-rank order of torch's ScheduleZBVZeroBubble (its own method, on a stand-in
    for the object, so no process group is needed)."""
    from torch.distributed.pipelining.schedules import ScheduleZBVZeroBubble, _ComputationType

    ops = {_ComputationType.FORWARD: Op.F, _ComputationType.BACKWARD_INPUT: Op.BI,
           _ComputationType.BACKWARD_WEIGHT: Op.BW}  # fmt: skip
    out = []
    for rank in range(p):
        me = SimpleNamespace(pp_group_size=p, num_stages=2 * p, _n_microbatches=m)
        actions = ScheduleZBVZeroBubble._calculate_single_rank_operations(me, rank)  # type: ignore[arg-type]
        out.append(
            [
                Action(ops[a.computation_type], a.stage_index, a.microbatch_index)
                for a in actions
                if a is not None
            ]
        )
    return out


@pytest.mark.parametrize("p", [1, 2, 3, 4])
def test_zb_v_is_torch_order_and_its_makespan(p: int) -> None:
    """ZB-V (Qi et al., arXiv 2401.10241v2, section 6) as torch builds it: the same
    program on every rank, stages in a V; with F = BI = BW = 1 per stage and m >= 2p - 1
    the step takes 6m + p - 1: rank p - 1 starts at p - 1 and then never waits."""
    for m in (1, p, 2 * p - 1, 2 * p, 3 * p):
        schedule = build("zb-v", p, m)
        assert schedule.stage_to_rank == (*range(p), *reversed(range(p)))
        mine = [[a for a in program if a.is_compute] for program in compute_only(schedule).ranks]
        assert mine == _torch_zbv_programs(p, m)
        spans = emulate(schedule)
        assert validate(schedule).makespan == max(end for _, end in spans)
        if m >= 2 * p - 1:
            assert max(end for _, end in spans) == 6 * m + p - 1


def slots(op: Op) -> int:
    return 1 if op in (Op.F, Op.B) else 0


@pytest.mark.parametrize("p", [2, 4, 6, 8])
def test_chimera_reaches_the_papers_bubble_ratio(p: int) -> None:
    """Li & Hoefler SC'21, Table 2: Chimera's bubble ratio is (D-2)/(2N+D-2) for D stages
    and N micro-batches per step, counting a forward and a backward as one slot each
    (ratio = idle slots / slots of the step, on every worker; 1F1B's (D-1)/(N+D-1) counts
    the same way). The formula holds only for equal F and B slots: with a backward twice
    a forward no order of p = m = 4 reaches it (exhaustive search: 16 units at best where
    the ratio would need 15); see plait.schedule.vshape.chimera."""
    for m in (p, 2 * p, 3 * p):
        schedule = build("chimera", p, m)
        spans = emulate(schedule, slots)
        makespan = max(end for _, end in spans)
        for r in range(p):
            assert busy(schedule, r, slots) == 2 * m  # m forwards and m backwards a rank
            assert 1 - busy(schedule, r, slots) / makespan == pytest.approx(
                (p - 2) / (2 * m + p - 2)
            )
        assert max(validate(schedule).peak_inflight) <= p  # the paper's D·M_a bound


def test_chimera_runs_half_the_microbatches_each_way_on_replicas() -> None:
    p, m = 4, 8
    schedule = build("chimera", p, m)
    assert schedule.pipelines == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert schedule.stage_to_rank == (0, 1, 2, 3, 3, 2, 1, 0)
    assert schedule.parts == (0, 1, 2, 3, 0, 1, 2, 3) and schedule.num_parts == p
    assert [schedule.replicas(k) for k in range(p)] == [(0, 4), (1, 5), (2, 6), (3, 7)]
    down = {a.microbatch for prog in schedule.ranks for a in prog if a.op is Op.F and a.stage < p}
    assert down == set(range(0, m, 2))
