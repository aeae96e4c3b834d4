"""`plait bench hetpipe` without workers: its cluster file marks the slow workers, the
planner's plan for it shares the batch by speed, and a run's updates and seconds to the
target loss are read off its per-step losses as the help says."""

from __future__ import annotations

import tomllib

import pytest

from plait.bench.hetpipe import Run, planned_pipelines
from plait.bench.hetpipe_config import HetPipeBenchConfig
from plait.presets import cluster_from_toml


def test_the_cluster_marks_the_last_workers_slower() -> None:
    config = HetPipeBenchConfig(workers=4, slow=1, slowdown=3.0)
    cluster = cluster_from_toml(tomllib.loads(config.cluster_toml()))
    assert [cluster.device(r).slowdown for r in range(4)] == [1.0, 1.0, 1.0, 3.0]
    fast, slow = cluster.device(0), cluster.device(3)
    assert fast.achievable_flops("fp32") == 3 * slow.achievable_flops("fp32")


def test_the_planned_pipelines_share_the_batch_by_speed() -> None:
    plan = planned_pipelines(HetPipeBenchConfig(), vocab_size=96)
    counts = [p["microbatches"] for p in plan["pipelines"]]
    slow = [p["devices"] == ["cpu-slow"] for p in plan["pipelines"]]
    assert len(counts) == plan["dp"] and sum(slow) >= 1
    # a pipeline of slow devices gets fewer micro-batches than one of fast devices
    assert max(c for c, s in zip(counts, slow, strict=True) if s) < max(
        c for c, s in zip(counts, slow, strict=True) if not s
    )


def test_the_target_is_reached_when_the_window_mean_is_at_most_it() -> None:
    run = Run(losses=[5.0, 4.0, 3.0, 2.5, 2.0], ends_s=[1.0, 2.0, 3.0, 4.0, 5.0])
    assert run.to_target(3.2, window=2) == (4, 4.0)  # mean(3.0, 2.5) = 2.75 after step 4
    assert run.to_target(3.5, window=2) == (3, 3.0)  # mean(4.0, 3.0) = 3.5
    assert run.to_target(1.0, window=2) == (None, None)
    assert run.samples_per_s(batch_size=10) == 5 * 10 / 5.0


@pytest.mark.parametrize(
    ("fields", "fragment"),
    [({"slow": 4}, "--slow 4"), ({"slowdown": 0.5}, "--slowdown 0.5"),
     ({"batch_size": 10}, "--batch-size 10"), ({"wsp_lr": "half"}, "--wsp-lr"),
     ({"block_ms": -1.0}, "--block-ms -1.0"), ({"micro_batch_size": 5}, "--micro-batch-size 5"),
     ({"micro_batch_size": -1}, "--micro-batch-size -1")],
)  # fmt: skip
def test_bad_input_is_refused_before_workers_start(
    fields: dict[str, object], fragment: str
) -> None:
    with pytest.raises(ValueError, match=fragment):
        HetPipeBenchConfig(**fields)  # type: ignore[arg-type]


def test_the_pad_counts_forward_and_backward_actions_only() -> None:
    from plait.emulate.slowdown import compute_seconds
    from plait.runtime.executor import ActionRecord

    records = [ActionRecord(0, 0, "0F0", 0.0, 1.0), ActionRecord(0, 1, "0SEND_F0", 1.0, 3.0),
               ActionRecord(0, 2, "1BI2v1", 3.0, 3.5), ActionRecord(0, 3, "0B0", 4.0, 6.0),
               ActionRecord(0, 4, "0UPDATE0", 6.0, 9.0)]  # fmt: skip
    assert compute_seconds(records) == 1.0 + 0.5 + 2.0


def test_emulated_compute_sleeps_per_block_and_sample_and_twice_in_backward() -> None:
    import torch
    from torch import nn

    from plait.emulate.slowdown import EmulatedCompute

    class TwoBlocks(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 1)

        def blocks(self) -> list[nn.Module]:
            return [self.a, self.b]

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(self.a(x))

    slept: list[float] = []
    model = TwoBlocks()
    emulated = EmulatedCompute(model, 0.5, 3.0, per_sample=True, sleep=slept.append)
    model(torch.ones(2, 4)).sum().backward()
    # fast: 0.5 s per block and sample, 2 samples; backward twice, last block first
    assert slept == [1.0, 1.0, 2.0, 2.0]
    slept.clear()
    emulated.slow = True
    model(torch.ones(1, 4)).sum().backward()
    assert slept == [1.5, 1.5, 3.0, 3.0]
