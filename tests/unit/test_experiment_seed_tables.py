"""Seeds 001 and 003's tables as the simulator predicts them (`plait experiment dp-vs-gpipe`
and `data-movement`): work counted from the models matches the convolution formula, the
ImageNet models have torchvision's parameter counts, predictions follow the cluster and
the setup they are given (not constants), and bad settings are refused by name. No
process is started: the measured halves run in tests/dist/test_experiment_seeds.py."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from torch import nn

from plait.experiment import data_movement as dm
from plait.experiment import dp_vs_gpipe as dg
from plait.experiment import dp_vs_gpipe_predict as dgp
from plait.experiment.work import count_work, median_abs_error, relative_error
from plait.models.imagenet import build_imagenet_model
from plait.models.resnet import ResNet18
from plait.presets import load_cluster


def _reference_forward_flops(model: nn.Module, shape: tuple[int, ...]) -> float:
    """2 × multiply-adds of every convolution and linear layer, from their output shapes."""
    total = 0.0

    def hook(module: nn.Module, inputs: object, output: torch.Tensor) -> None:
        nonlocal total
        if isinstance(module, nn.Conv2d):
            kh, kw = module.kernel_size
            per_out = kh * kw * module.in_channels // module.groups
            total += 2.0 * per_out * output.numel()
        elif isinstance(module, nn.Linear):
            total += 2.0 * module.in_features * module.out_features * output.shape[0]

    handles = [m.register_forward_hook(hook) for m in model.modules()]
    model.eval()  # batch norm over one sample of 1×1 features is refused in training mode
    with torch.no_grad():
        model(torch.zeros(1, *shape))
    for h in handles:
        h.remove()
    return total


@pytest.mark.parametrize(
    ("build", "shape"),
    [
        (lambda: ResNet18(width=4, num_classes=10), (3, 32, 32)),
        (lambda: build_imagenet_model("mobilenet_v2", width_mult=0.25, num_classes=10),
         (3, 32, 32)),
        (lambda: build_imagenet_model("resnet50", width_mult=0.125, num_classes=10), (3, 32, 32)),
    ],
)  # fmt: skip
def test_counted_forward_flops_match_the_convolution_formula(build: object, shape: tuple) -> None:
    torch.manual_seed(0)
    reference = _reference_forward_flops(build(), shape)  # type: ignore[operator]
    work = count_work(build(), shape)  # type: ignore[operator]
    assert math.isclose(sum(w.forward_flops for w in work), reference, rel_tol=1e-9)
    assert sum(w.num_params for w in work) == sum(p.numel() for p in build().parameters())  # type: ignore[operator]


@pytest.mark.parametrize(
    ("name", "millions"),
    # torchvision's model cards: parameters of resnet34, resnet50, vgg19, mobilenet_v2
    [("resnet34", 21.798), ("resnet50", 25.557), ("vgg19", 143.667), ("mobilenet_v2", 3.505)],
)
def test_imagenet_models_have_torchvisions_parameter_counts(name: str, millions: float) -> None:
    with torch.device("meta"):
        model = build_imagenet_model(name)
    assert round(sum(p.numel() for p in model.parameters()) / 1e6, 3) == millions
    assert len(model.blocks()) >= 6  # type: ignore[operator]


def test_error_helpers() -> None:
    assert relative_error(90.0, 100.0) == pytest.approx(0.1)
    assert relative_error(None, 100.0) is None and relative_error(1.0, None) is None
    assert median_abs_error([0.1, None, 0.3, 0.2]) == pytest.approx(0.2)
    assert median_abs_error([None]) is None


@pytest.fixture(scope="module")
def resnet18_work() -> list:
    return count_work(ResNet18(width=64, num_classes=100), (3, 32, 32))


def _cell(setup: dg.PaperSetup, work: list, cluster: object = None, **kw: object) -> dict:
    cluster = cluster or load_cluster(setup.cluster)
    return dg.predict_cell(cluster, setup, work, **kw)  # type: ignore[arg-type]


def test_input_bound_ddp_takes_the_loaders_time(resnet18_work: list) -> None:
    setup = dg.PaperSetup(loader_samples_per_s=50.0)  # far slower than the GPUs
    cell = _cell(setup, resnet18_work, method="ddp", gpus=4, dtype="fp32")
    steps = setup.epochs * math.ceil(setup.images / setup.batch_size)
    assert cell["bound"] == "input"
    assert cell["seconds"] == pytest.approx(steps * (setup.batch_size / 4) / 50.0)


def test_the_planners_pick_waits_for_its_input(resnet18_work: list) -> None:
    """A slow loader: the planner spreads the batch over 8 data-parallel replicas, each
    loading a 16-image share a step (a pipeline's fewer replicas would each load more),
    where on GPU time alone it picks a pipeline in fp16."""
    setup = dg.PaperSetup(loader_samples_per_s=100.0, dispatch_s=0.0)
    cluster = load_cluster(setup.cluster)
    pick = dgp._planner_pick(cluster, setup, resnet18_work, 8, "fp16")
    assert pick is not None
    steps = setup.epochs * math.ceil(setup.images / setup.batch_size)
    assert pick["plan"].startswith("dp=8 ") and " pp=1 " in pick["plan"], pick["plan"]
    assert pick["bound"] == "input"
    assert pick["seconds"] == pytest.approx(steps * (setup.batch_size / 8) / 100.0)


def test_predictions_move_with_the_cluster(resnet18_work: list) -> None:
    """GPU-bound (a fast loader, no dispatch cost): slower devices or links, slower steps."""
    setup = dg.PaperSetup(loader_samples_per_s=1e12, dispatch_s=0.0)
    base = load_cluster(setup.cluster)
    group = base.groups[0]
    slow_device = dataclasses.replace(group.device, efficiency=group.device.efficiency / 4)
    slower = dataclasses.replace(base, groups=(dataclasses.replace(group, device=slow_device),))
    thin_link = dataclasses.replace(group.intra_node, bandwidth_Bps=1e8)
    thin = dataclasses.replace(base, groups=(dataclasses.replace(group, intra_node=thin_link),))
    for method in ("ddp", "gpipe"):
        fast = _cell(setup, resnet18_work, base, method=method, gpus=4, dtype="fp32")
        slow = _cell(setup, resnet18_work, slower, method=method, gpus=4, dtype="fp32")
        narrow = _cell(setup, resnet18_work, thin, method=method, gpus=4, dtype="fp32")
        assert fast["bound"] == "gpu"
        assert slow["seconds"] > 2 * fast["seconds"]
        assert narrow["seconds"] > fast["seconds"]


def test_more_chunks_shrink_the_gpipe_bubble(resnet18_work: list) -> None:
    """GPipe's bubble (p - 1)/(m + p - 1) of the step: more micro-batches, less idle time."""
    gpu = {}
    for chunks in (4, 32):
        setup = dg.PaperSetup(loader_samples_per_s=1e12, dispatch_s=0.0, chunks=chunks,
                              batch_size=256)  # fmt: skip
        gpu[chunks] = _cell(setup, resnet18_work, method="gpipe", gpus=8, dtype="fp32")
    assert gpu[32]["gpu_step_s"] < gpu[4]["gpu_step_s"]


def test_table2_shares_follow_the_cost_model() -> None:
    setup = dm.PaperSetup(image_size=32, batch_size=64)
    cluster = load_cluster(setup.cluster)
    work = count_work(build_imagenet_model("resnet34"), (3, 32, 32))
    one = dm.predict_cell(cluster, setup, "resnet34", 1, work)
    batch_bytes = 64 * 3 * 32 * 32 * 4
    assert one["M"] == 0.0  # one GPU moves no parameters
    assert one["I"] == pytest.approx(100 * batch_bytes / setup.host_copy_Bps / one["step_s"])
    group = cluster.groups[0]
    fast = dataclasses.replace(group.intra_node, bandwidth_Bps=group.intra_node.bandwidth_Bps * 8)
    faster = dataclasses.replace(cluster, groups=(dataclasses.replace(group, intra_node=fast),))
    four = dm.predict_cell(cluster, setup, "resnet34", 4, work)
    four_fast = dm.predict_cell(faster, setup, "resnet34", 4, work)
    assert 0 < four_fast["M"] < four["M"]
    seconds = {n: c["I"] * c["step_s"] for n, c in ((1, one), (4, four))}
    assert seconds[4] > seconds[1]  # GPU 0 scatters the shards after the copy


@pytest.mark.parametrize(
    ("fields", "named"),
    [({"workers": (0,)}, "workers"), ({"workers": (11,)}, "workers"), ({"epochs": 0}, "epochs"),
     ({"dtypes": ("fp8",)}, "fp8"), ({"data": "imagenet"}, "data"),
     ({"batch_size": 10, "workers": (4,)}, "batch_size"), ({"width": 0}, "width")],
)  # fmt: skip
def test_dp_config_refuses_bad_values(fields: dict, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        dg.DpGpipeConfig(**fields)


@pytest.mark.parametrize(
    ("fields", "named"),
    [({"models": ("alexnet",)}, "models"), ({"workers": (0,)}, "workers"),
     ({"batch_size": 10, "workers": (3,)}, "batch_size"), ({"image_size": 16}, "image_size"),
     ({"steps": 0}, "steps"), ({"width_mult": 0.0}, "width_mult")],
)  # fmt: skip
def test_movement_config_refuses_bad_values(fields: dict, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        dm.DataMovementConfig(**fields)


def test_a_gpipe_task_cost_follows_gpipes_closed_form(resnet18_work: list) -> None:
    """On infinitely fast devices and links only the per-task cost t is left: GPipe's step
    is (m + p - 1) ticks of forward t plus backward 2t (torchgpipe recomputes the forward,
    task included), as its schedule's closed form says; `implied_task_s` inverts it."""
    base = load_cluster("dgx-a100-80gb")
    group = base.groups[0]
    fast = dataclasses.replace(group.device, peak_flops={"fp32": 1e30},
                               memory_bandwidth_Bps=1e30)  # fmt: skip
    link = dataclasses.replace(group.intra_node, latency_s=0.0, bandwidth_Bps=1e30)
    cluster = dataclasses.replace(base, groups=(dataclasses.replace(group, device=fast,
                                                                    intra_node=link),))  # fmt: skip
    m, p, t = 8, 4, 1e-3
    setup = dg.PaperSetup(loader_samples_per_s=1e30, dispatch_s=0.0, chunks=m, task_s=t)
    cell = dg.predict_cell(cluster, setup, resnet18_work, method="gpipe", gpus=p, dtype="fp32")
    assert cell["gpu_step_s"] == pytest.approx((m + p - 1) * 3 * t, rel=1e-6)
    free = dataclasses.replace(setup, task_s=0.0)
    implied = dg.implied_task_s(cluster, free, resnet18_work, gpus=p, dtype="fp32",
                                seconds=cell["seconds"])  # fmt: skip
    assert implied == pytest.approx(t, rel=1e-4)


class _Blocks(nn.Module):
    def __init__(self, *blocks: nn.Module) -> None:
        super().__init__()
        self.parts = nn.ModuleList(blocks)

    def blocks(self) -> list[nn.Module]:
        return list(self.parts)


def test_winograd_flops_are_the_3x3_stride_1_convolutions() -> None:
    # 3×3 stride 1 (Winograd-shaped), 3×3 stride 2 and 1×1 (not), each alone in a block
    model = _Blocks(nn.Conv2d(4, 8, 3, padding=1, bias=False),
                    nn.Conv2d(8, 8, 3, stride=2, padding=1, bias=False),
                    nn.Conv2d(8, 6, 1, bias=False))  # fmt: skip
    work = count_work(model, (4, 8, 8))
    direct = 2.0 * 4 * 9 * 8 * 8 * 8  # 2 × in × k² × out channels × output pixels
    assert work[0].forward_winograd_flops == pytest.approx(direct)
    # backward: the input gradient (the first block's input needs none) and the weight's
    assert work[0].backward_winograd_flops == pytest.approx(direct)
    assert work[1].forward_winograd_flops == 0.0 and work[2].forward_winograd_flops == 0.0
    assert work[1].backward_winograd_flops == 0.0 and work[2].backward_winograd_flops == 0.0


def test_memory_bound_operators_cost_their_traffic_and_convolutions_their_flops() -> None:
    from plait.cluster import Device
    from plait.experiment.work import block_costs

    model = _Blocks(nn.Conv2d(3, 4, 3, padding=1, bias=False), nn.ReLU())
    work = count_work(model, (3, 6, 6))
    elems = 4 * 6 * 6
    # relu reads its input and writes its output; its backward reads the gradient and the
    # saved output and writes the input's gradient
    assert work[1].forward_memory_elems == 2 * elems
    assert work[1].backward_memory_elems == 3 * elems
    assert work[0].forward_memory_elems == 0.0  # the convolution is priced by its FLOPs
    dev = Device(name="d", peak_flops={"fp32": 1e12}, efficiency=0.5, memory_bytes=2**30,
                 memory_bandwidth_Bps=1e9)  # fmt: skip
    direct = 2.0 * 3 * 9 * elems
    costs = block_costs(work, dev, "fp32", 8, winograd=2.25)
    assert costs[0].forward_flops == pytest.approx(8 * direct / 2.25)
    seconds = 8 * 2 * elems * 4 / 1e9  # bytes over the memory bandwidth
    assert costs[1].forward_flops == pytest.approx(seconds * 0.5e12)
    with pytest.raises(ValueError, match=r"winograd=0\.5"):
        block_costs(work, dev, "fp32", 8, winograd=0.5)


def test_a_rerun_keeps_the_hand_written_preface_and_discussion(tmp_path: object) -> None:
    from pathlib import Path

    from plait.experiment import dp_vs_gpipe as dg
    from plait.experiment.report import run_all

    out = Path(str(tmp_path))
    (out / "preface.md").write_text("Run on a quiet machine.\n")
    (out / "discussion.md").write_text("The shares agree.\n")
    movement = dm.DataMovementConfig(models=("mobilenet_v2",))
    for _ in range(2):  # the second run resumes from results.json
        run_all(out, dp=dg.DpGpipeConfig(), movement=movement, staleness=None, quiet=True,
                measure=False)  # fmt: skip
    text = (out / "report.md").read_text()
    assert text.index("Run on a quiet machine.") < text.index("## Data parallelism vs GPipe")
    assert text.index("## Plots") < text.index("## Discussion\n\nThe shares agree.")


@pytest.mark.parametrize("gpus", [2, 4])
def test_torchgpipe_issues_every_stage_on_one_host(resnet18_work: list, gpus: int) -> None:
    """A host far slower than the GPUs (1 ms an operator) and a free loader: torchgpipe's
    one process issues, per micro-batch, every block's forward, recomputed forward and
    backward, whatever the GPU count; DDP's processes each issue one forward and backward.
    Each block action costs its share of the model's counted operators."""
    per_op = 1e-3
    setup = dg.PaperSetup(loader_samples_per_s=1e30, dispatch_s=per_op)
    ops = sum(w.forward_ops + w.backward_ops for w in resnet18_work)
    per_action = per_op * ops / (2 * len(resnet18_work))
    steps = setup.epochs * math.ceil(setup.images / setup.batch_size)
    cell = _cell(setup, resnet18_work, method="gpipe", gpus=gpus, dtype="fp32")
    expected = setup.chunks * 3 * len(resnet18_work) * per_action
    assert cell["bound"] == "host"
    assert cell["seconds"] == pytest.approx(steps * expected, rel=1e-6)
    ddp = _cell(setup, resnet18_work, method="ddp", gpus=gpus, dtype="fp32")
    # after the last backward the gradient all-reduce's tail and the SGD step remain:
    # under 1% of a step this host-bound
    assert steps * per_op * ops < ddp["seconds"] < 1.01 * steps * per_op * ops
