"""Recomputation per pipeline stage: the config's rules, the flags, and the simulator's
price of each stage under its own mode."""

from __future__ import annotations

import argparse

import pytest

from plait.cli.options import word_list
from plait.config import ParallelPlan
from plait.cost import StageCost
from plait.plan import gpt_spec
from plait.presets import load_cluster
from plait.sim import SimPlan, SimResult, build_schedule, simulate

CLUSTER = load_cluster("dgx-a100-80gb")
MODEL = gpt_spec(num_layers=8, hidden=1024, num_heads=16, seq_len=1024, vocab_size=1000)


SIZES = (3, 2, 2, 3)


def _simulate(**kw: object) -> SimResult:
    """One step of 1F1B over 4 ranks, the blocks cut as SIZES whatever the modes."""
    plan = SimPlan(pp=4, schedule="1f1b", microbatches=8, micro_batch_size=4, seq_len=1024,
                   **kw)  # type: ignore[arg-type]  # fmt: skip
    blocks, stages, first = MODEL.blocks_for(plan), [], 0
    for n in SIZES:
        stages.append(StageCost(tuple(blocks[first : first + n])))
        first += n
    return simulate(build_schedule(plan), stages, CLUSTER, plan)


def test_each_rank_holds_what_its_own_mode_keeps() -> None:
    """Each rank's peak memory is the one it has when every stage runs its mode: a rank's
    memory depends on its own stage alone."""
    modes = ("full", "selective", "none", "full")
    mixed = _simulate(recompute_stages=modes)
    uniform = {m: _simulate(recompute=m) for m in ("none", *modes)}
    for rank, mode in enumerate(modes):
        assert mixed.peak_memory_bytes[rank] == pytest.approx(
            uniform[mode].peak_memory_bytes[rank], rel=1e-12
        ), (rank, mode)
    # the step is slower than recomputing nothing and faster than recomputing everything
    assert uniform["none"].step_time_s < mixed.step_time_s < uniform["full"].step_time_s


@pytest.mark.parametrize(
    ("values", "match"),
    [
        ({"pp": 2, "recompute_stages": ("full",)}, "gives 1 modes for 2 stages"),
        ({"pp": 2, "recompute_stages": ("fast", "none")}, "each of"),
        ({"pp": 2, "recompute": "full", "recompute_stages": ("full", "none")}, "give one mode"),
    ],
)
def test_bad_per_stage_modes_are_refused(values: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ParallelPlan(**values)  # type: ignore[arg-type]


def test_files_without_per_stage_modes_read_as_before() -> None:
    assert "recompute_stages" not in ParallelPlan(pp=2).to_dict()
    plan = ParallelPlan(pp=2, recompute_stages=["full", "none"])  # type: ignore[arg-type]
    assert plan.to_dict()["recompute_stages"] == ("full", "none")
    assert [plan.recompute_of(s) for s in range(2)] == ["full", "none"]


def test_the_flag_names_a_wrong_mode() -> None:
    words = ("none", "selective", "full")
    assert word_list(words, "full, none") == ("full", "none")
    with pytest.raises(argparse.ArgumentTypeError, match="'fast' is not one of"):
        word_list(words, "full,fast")
