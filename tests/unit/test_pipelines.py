"""Where the pipelines of a heterogeneous plan sit, and which ranks share each block."""

from __future__ import annotations

import pytest

from plait.config import ParallelPlan, PipelineSpec
from plait.pipelines import pipeline_layout


def test_pipelines_of_different_depths_take_consecutive_ranks() -> None:
    layout = pipeline_layout([(4,), (1, 2, 1)], [2, 4])
    assert layout.ranks == ((0,), (1, 2, 3))
    # block 0 on ranks 0 and 1, blocks 1-2 on 0 and 2, block 3 on 0 and 3
    assert layout.block_groups() == {(0, 1): (0,), (0, 2): (1, 2), (0, 3): (3,)}
    assert layout.batch_shares() == (2 / 6, 4 / 6)
    assert [layout.pipeline_of(r) for r in range(4)] == [0, 1, 1, 1]


def test_pipelines_of_one_depth_follow_the_rank_order() -> None:
    # tp-dp-pp: replicas innermost, so pipeline d holds ranks d and d + 2
    layout = pipeline_layout([(3, 1), (1, 3)], [3, 1])
    assert layout.ranks == ((0, 2), (1, 3))
    assert layout.block_groups() == {(0, 1): (0,), (0, 3): (1, 2), (2, 3): (3,)}
    assert pipeline_layout([(3, 1), (1, 3)], [3, 1], rank_order="tp-pp-dp").ranks == (
        (0, 1),
        (2, 3),
    )


def test_interleaved_pipelines_put_stage_s_on_rank_s_mod_pp() -> None:
    layout = pipeline_layout([(1, 1, 1, 1), (1, 1, 1, 1)], [2, 2], chunks=2)
    assert layout.ranks == ((0, 2), (1, 3))
    assert [layout.holder(1, b) for b in range(4)] == [1, 3, 1, 3]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"dp": 3}, "pipelines=2 pipelines but dp=3"),
        ({"tp": 2}, "tp=2 with pipelines"),
        ({"zero": 1}, "zero=1 with pipelines"),
        ({"schedule": "pipedream"}, "asynchronous"),
        (
            {"pipelines": ({"partition": [2, 2], "microbatches": 1}, {"partition": [3]})},
            "microbatches",
        ),
        ({"chunks": 2, "schedule": "interleaved"}, "not a multiple of chunks=2"),
    ],
)
def test_plans_the_runtime_cannot_apply_are_refused(
    kwargs: dict[str, object], message: str
) -> None:
    base: dict[str, object] = {
        "dp": 2,
        "pp": 1,
        "pipelines": (
            PipelineSpec(partition=(4,), microbatches=2),
            PipelineSpec(partition=(1, 2, 1), microbatches=4),
        ),
    }
    with pytest.raises(ValueError, match=message):
        ParallelPlan(**{**base, **kwargs})  # type: ignore[arg-type]


def test_wsp_needs_replicas() -> None:
    with pytest.raises(ValueError, match="wsp_staleness=1 with dp=1"):
        ParallelPlan(pp=2, wsp_staleness=1)
    with pytest.raises(ValueError, match="wsp_staleness=-1"):
        ParallelPlan(dp=2, pp=1, wsp_staleness=-1)
    assert ParallelPlan(dp=2, pp=1, wsp_staleness=0).world_size == 2


def test_wsp_checkpoints_fall_at_the_end_of_a_wave() -> None:
    from plait.config import TrainConfig

    wsp = ParallelPlan(dp=2, pp=1, wsp_staleness=1, wsp_wave=2)
    with pytest.raises(ValueError, match="checkpoint_every=5 is not a multiple of wsp_wave=2"):
        TrainConfig(parallel=wsp, checkpoint_every=5)
    assert TrainConfig(parallel=wsp, checkpoint_every=4).checkpoint_every == 4
