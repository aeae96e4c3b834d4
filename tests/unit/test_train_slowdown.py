"""`plait train --cluster FILE`: rank r takes its device r's slowdown, and a slowed rank
sleeps (k − 1) × its step's forward and backward seconds after the step."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from plait.config import ParallelPlan, TrainConfig
from plait.runtime.executor import ActionRecord
from plait.train.slowdown import check_cluster, check_config, padded_step

_CLUSTER = """name = "mixed"
inter_node = { latency_s = 2e-5, bandwidth_Bps = 4e9 }

[[nodes]]
count = 1
devices_per_node = 2
intra_node = { latency_s = 2e-5, bandwidth_Bps = 4e9 }
device = { name = "fast", peak_flops = { fp32 = 2e10 }, memory_gib = 4 }

[[nodes]]
count = 1
devices_per_node = 1
intra_node = { latency_s = 2e-5, bandwidth_Bps = 4e9 }
device = { name = "slow", peak_flops = { fp32 = 2e10 }, memory_gib = 4, slowdown = 2.5 }
"""


@pytest.fixture
def cluster(tmp_path: Path) -> str:
    path = tmp_path / "mixed.toml"
    path.write_text(_CLUSTER)
    return str(path)


def test_ranks_take_their_devices_slowdown_in_rank_order(cluster: str) -> None:
    assert check_cluster(cluster, 3) == (1.0, 1.0, 2.5)
    assert check_cluster(cluster, 2) == (1.0, 1.0)  # fewer workers: the first devices


def test_a_cluster_of_too_few_devices_or_no_file_is_refused_before_training(
    cluster: str, tmp_path: Path
) -> None:
    check_config(TrainConfig(parallel=ParallelPlan(dp=3, pp=1), batch_size=12, cluster=cluster))
    with pytest.raises(ValueError, match="3 devices for 4 workers"):
        check_config(TrainConfig(parallel=ParallelPlan(dp=4, pp=1), batch_size=16, cluster=cluster))
    missing = str(tmp_path / "nope.toml")
    with pytest.raises(ValueError, match=r"nope\.toml"):
        check_config(TrainConfig(parallel=ParallelPlan(dp=2, pp=1), batch_size=8, cluster=missing))


def test_plait_train_refuses_a_cluster_of_too_few_devices(cluster: str) -> None:
    from plait.cli.main import main

    argv = ["train", "--cluster", cluster, "--dp", "4", "--pp", "1", "--batch-size", "16",
            "--dry-run"]  # fmt: skip
    assert main(argv) == 2


class _Engine:
    """A step whose records say 2 s of forward/backward and 5 s of other actions."""

    def __init__(self) -> None:
        self.steps = 0
        records = [
            ActionRecord(0, 0, "0F0", 0.0, 0.5),
            ActionRecord(0, 1, "0SEND_F0", 0.5, 3.0),  # a send: not compute
            ActionRecord(0, 2, "0F1", 3.0, 3.5),
            ActionRecord(0, 3, "0B0", 3.5, 4.0),
            ActionRecord(0, 4, "0REDUCE0", 4.0, 6.5),  # an all-reduce: not compute
            ActionRecord(0, 5, "0B1", 6.5, 7.0),
        ]
        self.report = SimpleNamespace(result=SimpleNamespace(records=records))

    def step(self, batch: object) -> object:
        self.steps += 1
        return self.report


def test_a_slowed_rank_sleeps_its_pad_after_each_step() -> None:
    compute = 0.5 + 0.5 + 0.5 + 0.5  # the F and B records above
    for slowdown, pads in ((2.5, [1.5 * compute] * 3), (1.0, [])):
        engine, slept = _Engine(), []
        for _ in range(3):
            assert padded_step(engine, None, slowdown, sleep=slept.append) is engine.report
        assert engine.steps == 3
        assert slept == pytest.approx(pads)
