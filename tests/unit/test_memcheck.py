"""The memory estimate taken before workers start: model state exact, activations within
the span a forward pass really saves, and an impossible batch refused in one line."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from plait.cli.main import main
from plait.config import load_config
from plait.train.memcheck import check_memory, estimate_memory
from plait.train.task import task_from_config


@pytest.mark.parametrize("sizes", [{}, {"model.hidden": 256, "model.layers": 6, "model.heads": 8}])
def test_estimate_matches_the_model_it_would_train(sizes: dict[str, int]) -> None:
    cfg = load_config(data="synthetic", **{"parallel.pp": 1, "parallel.microbatches": 1}, **sizes)
    found = estimate_memory(cfg, 1)
    assert found is not None
    task = task_from_config(cfg)
    model = task.model()
    params = sum(p.numel() for p in model.parameters())
    # fp32 AdamW: weights, gradients and two moments, 16 bytes a parameter
    assert found.model_state_bytes == params * 16
    saved: dict[int, int] = {}
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    inputs, targets = task.batch(0)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        task.loss(model(inputs), targets)
    # what backward keeps (the cost model counts its tensors, to 1%), plus at most the
    # working set of one block: not far above
    assert 0.99 * sum(saved.values()) <= found.activation_bytes <= 2 * sum(saved.values())


def test_an_impossible_batch_is_refused_before_any_worker_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    argv = ["train", "--dry-run", "--pp", "2", "--batch-size", "512", "--seq-len", "2048",
            "--hidden", "1024", "--layers", "24", "--heads", "16"]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "batch_size=512 × seq_len=2048" in err and "use a smaller --batch-size" in err
    assert len(err.splitlines()) == 1 and list(tmp_path.iterdir()) == []


def test_auto_planning_is_refused_only_when_no_layout_can_fit() -> None:
    sizes = {"model.hidden": 256, "model.layers": 4, "model.heads": 8, "batch_size": 64}
    cfg = load_config(data="synthetic", plan="auto", **sizes)
    found = estimate_memory(cfg, 2)
    assert found is not None and "recompute=full" in found.layout
    check_memory(cfg, 2, available=found.peak_bytes)  # exactly enough
    with pytest.raises(ValueError, match="even the most frugal layout"):
        check_memory(cfg, 2, available=found.peak_bytes * 0.99)
    # a fixed layout holds more: every micro-batch's activations, no recomputation
    fixed = load_config(data="synthetic", **{**sizes, "parallel.pp": 2})
    held = estimate_memory(fixed, 2)
    assert held is not None and held.peak_bytes > found.peak_bytes


@pytest.mark.parametrize(
    "model", [{"model.name": "resnet18", "data": "synthetic"}, {"model.name": "moe-gpt"}]
)
def test_models_outside_the_cost_model_get_a_bound_below_their_need(model: dict[str, str]) -> None:
    cfg = load_config(**{"parallel.pp": 1, "batch_size": 8, **model})  # type: ignore[arg-type]
    found = estimate_memory(cfg, 2)
    assert found is not None and found.bound
    task = task_from_config(cfg)
    real = task.model()
    params = sum(p.numel() for p in real.parameters())
    # fp32 AdamW: weights, gradients and two moments, 16 bytes a parameter, over 2 workers
    assert found.model_state_bytes == params * 16 / 2
    drawn = sum(x.numel() * x.element_size() for x in task.batch(0))
    assert found.batch_bytes == drawn  # the whole global batch, on every worker
    check_memory(cfg, 2, available=found.peak_bytes)  # at the bound: allowed
    with pytest.raises(ValueError, match=r"batch_size=8 \(.*\): each worker needs at least"):
        check_memory(cfg, 2, available=found.peak_bytes * 0.99)


def test_a_batch_of_ten_billion_is_refused_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # it used to simulate 10^10 micro-batches (minutes) and then pass: no layout counted the
    # batch's own tokens, which every worker draws in full
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--batch-size", "10000000000"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and list(tmp_path.iterdir()) == []
    assert "batch_size=10000000000" in err and "use a smaller --batch-size" in err
    cfg = load_config(data="synthetic", plan="auto", batch_size=10_000_000_000)
    found = estimate_memory(cfg, 2)
    assert found is not None and found.batch_bytes == 10_000_000_000 * (cfg.model.seq_len + 1) * 8


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved"])
def test_many_microbatches_are_extrapolated_as_simulated(
    schedule: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import plait.train.memcheck as memcheck

    chunks = 2 if schedule == "interleaved" else 1
    cfg = load_config(data="synthetic", batch_size=48, **{
        "parallel.pp": 2, "parallel.microbatches": 24, "parallel.schedule": schedule,
        "parallel.chunks": chunks, "model.layers": 4})  # fmt: skip
    simulated = estimate_memory(cfg, 2)  # 24 micro-batches: under the cap, simulated in full
    monkeypatch.setattr(memcheck, "_MAX_SIMULATED_MICROBATCHES", 2)
    extrapolated = estimate_memory(cfg, 2)  # from 8 and 6 (interleaved), or 4 and 2
    assert simulated is not None and extrapolated is not None
    assert extrapolated.peak_bytes == pytest.approx(simulated.peak_bytes, rel=1e-9)
    assert extrapolated.activation_bytes == pytest.approx(simulated.activation_bytes, rel=1e-9)


def test_a_heterogeneous_plan_is_judged_by_its_worst_pipeline() -> None:
    from plait.config import ParallelPlan, PipelineSpec, TrainConfig

    pipes = (PipelineSpec(partition=(6,), microbatches=2),
             PipelineSpec(partition=(3, 3), microbatches=2))  # fmt: skip
    cfg = load_config(data="synthetic", batch_size=8)
    hetero = TrainConfig(**{**cfg.__dict__, "nproc": 3,
                            "parallel": ParallelPlan(dp=2, pp=2, pipelines=pipes)})  # fmt: skip
    found = estimate_memory(hetero, 3)
    # each pipeline on its own: 2 micro-batches of 2 samples (8 over 4 micro-batches)
    alone = [
        estimate_memory(TrainConfig(**{**cfg.__dict__, "batch_size": 4, "nproc": pp,
                                       "parallel": ParallelPlan(pp=pp, microbatches=2)}), pp)
        for pp in (1, 2)
    ]  # fmt: skip
    assert found is not None and all(a is not None for a in alone)
    # the batch's bytes are the whole global batch's on every worker
    want = max(a.peak_bytes - a.batch_bytes for a in alone) + found.batch_bytes  # type: ignore[union-attr]
    assert found.peak_bytes == pytest.approx(want)
