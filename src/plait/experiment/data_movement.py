"""The share of a data-parallel step spent moving input batches (I) and model state (M):
seed 003's Table 2, measured on this machine's workers and predicted on the paper's GPUs.

Seed 003 (§3, Table 2) trained ResNet-34, ResNet-50, VGG-19 and MobileNetV2 at batch 256
with data parallelism on 1 to 4 GTX 1080 Ti GPUs over PCIe and found 12-38% of a step
moving input batches and up to 21% moving parameters, growing with the GPU count; its
remedies are CPU-side input splitting, pre-loading overlapped with compute, and weight
compression. The step it describes is `torch.nn.DataParallel`'s: the batch is copied from
the host to GPU 0 and scattered from there, the weights are broadcast from GPU 0 to every
replica each step, and the gradients are reduced back to GPU 0.

Measured here (`measure`): `workers` gloo processes train each model (narrowed by
`width_mult`, on `image_size` images) with the step instrumented. Baseline: rank 0 runs
the input pipeline for the whole batch (per-image random crop, flip, normalisation) and
scatters the shards (the host-to-GPU-0-then-scatter path); the gradients are all-reduced
in fp32. Remedies: every worker builds its own shard (input split on the CPU side) in a
background thread one step ahead (pre-loading), and the gradients are all-reduced in fp16
(`--compress fp16`'s cast). I and M are the seconds the step waits for each, over the
step's seconds (rank 0's, median over the timed steps).

Predicted (`predict`): the same DataParallel step on the cluster file (`gtx1080ti-pcie`):
input copy at the host's pageable-copy bandwidth plus the scatter over PCIe, weight
broadcast and gradient reduction from GPU 0 over PCIe (GeForce cards copy through the
host, one replica after another), and each replica's forward and backward of its share
as the simulator replays it (block costs counted per operator, with the 3×3 convolutions'
Winograd arithmetic: `plait.experiment.work`); the step is their sum, since DataParallel
runs them in turn. Memory beyond the device's capacity is reported as the paper's ×.
Limits: the pageable copy bandwidth is an assumption (`host_copy_Bps`); JPEG decoding
before the copy is not modelled; on CPU workers "transfer" is gloo over shared memory.
"""

from __future__ import annotations

import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from plait.cluster import Cluster, Link
from plait.cost import StageCost, all_reduce_time
from plait.experiment.work import (
    BlockWork,
    block_costs,
    count_work,
    median_abs_error,
    relative_error,
)
from plait.presets import load_cluster
from plait.sim import SimPlan, build_schedule, simulate

__all__ = ["MODELS", "PUBLISHED", "DataMovementConfig", "PaperSetup", "measure", "predict",
           "run_experiment"]  # fmt: skip

MODELS = ("resnet34", "resnet50", "vgg19", "mobilenet_v2")
# Seed 003, Table 2: per model and GPU count, (I %, M %); None where the paper has × (OOM).
PUBLISHED: dict[str, dict[int, tuple[float, float] | None]] = {
    "resnet34": {1: (12.63, 0.0), 2: (22.17, 4.11), 3: (26.20, 5.29), 4: (31.14, 8.57)},
    "resnet50": {1: None, 2: None, 3: (16.89, 3.61), 4: (22.53, 6.52)},
    "vgg19": {1: None, 2: None, 3: (8.54, 12.58), 4: (11.29, 21.17)},
    "mobilenet_v2": {1: None, 2: (23.13, 0.64), 3: (30.59, 0.85), 4: (38.17, 1.01)},
}


@dataclass(frozen=True, kw_only=True)
class PaperSetup:
    """Seed 003's runs: ImageNet-sized inputs at batch 256 in fp32 on `cluster`."""

    cluster: str = "gtx1080ti-pcie"
    batch_size: int = 256
    image_size: int = 224
    gpus: tuple[int, ...] = (1, 2, 3, 4)
    # assumed: a DataLoader without pinned memory copies pageable host memory, staged
    # through a pinned buffer, at about a quarter of PCIe 3.0's pinned rate
    host_copy_Bps: float = 3e9
    peer_to_peer: bool = False  # GeForce cards: GPU-to-GPU copies go through the host
    # cuDNN runs Pascal's fp32 3×3 stride-1 convolutions as Winograd F(2×2, 3×3):
    # 2.25× fewer multiplications (Lavin and Gray, 2016)
    winograd: float = 2.25


@dataclass(frozen=True, kw_only=True)
class DataMovementConfig:
    """What to measure here (a reduced size, stated in the report)."""

    models: tuple[str, ...] = MODELS
    workers: tuple[int, ...] = (1, 2, 3, 4)
    batch_size: int = 24
    image_size: int = 32
    width_mult: float = 0.25
    steps: int = 3
    warmup: int = 1
    seed: int = 0

    def __post_init__(self) -> None:
        bad = [m for m in self.models if m not in MODELS]
        if bad or not self.models:
            raise ValueError(f"models={list(self.models)}: choose from {list(MODELS)}")
        if not self.workers or min(self.workers) < 1 or max(self.workers) > 8:
            raise ValueError(f"workers={list(self.workers)}: give counts from 1 to 8")
        for w in self.workers:
            if self.batch_size % w:
                raise ValueError(f"batch_size={self.batch_size} is not divisible by "
                                 f"workers={w}: use a multiple of every worker count")  # fmt: skip
        for name in ("batch_size", "image_size", "steps", "warmup"):
            if getattr(self, name) < (0 if name == "warmup" else 1):
                raise ValueError(f"{name}={getattr(self, name)} is too small")
        if self.image_size < 32:
            raise ValueError(f"image_size={self.image_size} must be >= 32 (five halvings)")
        if not self.width_mult > 0:
            raise ValueError(f"width_mult={self.width_mult} must be > 0")


# ------------------------------------------------------------------ prediction
def predict_cell(cluster: Cluster, setup: PaperSetup, model: str, gpus: int,
                 work: Sequence[BlockWork]) -> dict[str, Any]:  # fmt: skip
    """I and M shares (percent) of nn.DataParallel's step of `model` on `gpus` GPUs, from
    `work`, its per-sample work (`count_work`)."""
    dev = cluster.device(0)
    share = setup.batch_size // gpus
    batch_bytes = setup.batch_size * 3 * setup.image_size**2 * 4
    params = sum(w.num_params for w in work) * 4
    input_s = batch_bytes / setup.host_copy_Bps
    model_s = 0.0
    if gpus > 1:
        link = cluster.link(0, 1)
        if not setup.peer_to_peer:  # staged through host memory: PCIe crossed twice
            link = Link(latency_s=2 * link.latency_s, bandwidth_Bps=link.bandwidth_Bps / 2)
        input_s += (gpus - 1) * link.time(batch_bytes / gpus)  # GPU 0 scatters the shards
        # weights broadcast from GPU 0 and gradients reduced to it: together the traffic
        # of one ring all-reduce (a reduce-scatter and an all-gather)
        model_s = all_reduce_time(gpus, params, link, algorithm="ring")
    plan = SimPlan(schedule="gpipe", microbatches=1, micro_batch_size=share, dtype="fp32",
                   optimizer="sgd")  # fmt: skip
    stage = StageCost(tuple(block_costs(work, dev, "fp32", share, winograd=setup.winograd)))
    result = simulate(build_schedule(plan), [stage], cluster, plan)
    step = input_s + model_s + result.step_time_s
    return {"I": 100 * input_s / step, "M": 100 * model_s / step, "step_s": step,
            "compute_s": result.step_time_s, "memory_gib": result.peak_memory_bytes[0] / 2**30,
            "fits": not result.overflows}  # fmt: skip


def predict(setup: PaperSetup, models: tuple[str, ...] = MODELS,
            cluster: Cluster | None = None) -> dict[str, Any]:  # fmt: skip
    """Table 2 as the simulator predicts it, beside the published shares and their errors."""
    from plait.models.imagenet import build_imagenet_model

    cluster = cluster or load_cluster(setup.cluster)
    rows, errors = [], []
    for model in models:
        with torch.device("meta"):  # counted only: no weights for VGG-19's 143M parameters
            net = build_imagenet_model(model)
        work = count_work(net, (3, setup.image_size, setup.image_size))
        for g in setup.gpus:
            cell = predict_cell(cluster, setup, model, g, work)
            pub = PUBLISHED[model].get(g)
            cell.update({"model": model, "gpus": g, "published": pub and list(pub)})
            cell["error_I"] = relative_error(cell["I"], pub and pub[0])
            # an M of 0 (one GPU) has no relative error; it is compared as an absolute 0
            cell["error_M"] = relative_error(cell["M"], pub[1]) if pub and pub[1] else None
            errors += [cell["error_I"], cell["error_M"]]
            rows.append(cell)
    # the paper's × against the simulator's memory check (a cell fits or not)
    oom = [(r["published"] is None) == (not r["fits"]) for r in rows]
    return {"setup": asdict(setup), "cluster": cluster.name, "rows": rows,
            "memory_agreement": [sum(oom), len(oom)],
            "median_error": median_abs_error(errors),
            "median_error_I": median_abs_error([r["error_I"] for r in rows]),
            "median_error_M": median_abs_error([r["error_M"] for r in rows])}  # fmt: skip


# ------------------------------------------------------------------ measurement
class _Pipeline:
    """The input pipeline: uint8 images padded by 4, cropped at random, flipped at random
    and normalised one image at a time (as torchvision's per-sample transforms)."""

    def __init__(self, size: int, pool: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.images = torch.randint(0, 256, (pool, 3, size + 8, size + 8), dtype=torch.uint8,
                                    generator=g)  # fmt: skip
        self.size, self.g = size, g

    def batch(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        out = torch.empty(n, 3, self.size, self.size)
        picks = torch.randint(0, len(self.images), (n,), generator=self.g)
        for i, k in enumerate(picks.tolist()):
            dy, dx = torch.randint(0, 9, (2,), generator=self.g).tolist()
            img = self.images[k, :, dy : dy + self.size, dx : dx + self.size].float()
            if torch.rand((), generator=self.g) < 0.5:
                img = img.flip(-1)
            out[i] = img.div_(255.0).sub_(0.5).div_(0.25)
        return out, picks % 10


def _worker(config: DataMovementConfig, model_name: str) -> dict[str, Any]:
    import torch.distributed as dist

    from plait.mesh import init_worker

    torch.set_num_threads(1)  # workers share this machine's cores
    env, _ = init_worker(timeout_s=120.0, device="cpu")  # CPU models: CPU workers, gloo
    try:
        return {v: _timed_steps(env.rank, env.world_size, config, model_name, v)
                for v in ("base", "remedy")}  # fmt: skip
    finally:
        dist.destroy_process_group()


def _timed_steps(rank: int, world: int, config: DataMovementConfig, model_name: str,
                 variant: str) -> dict[str, float]:  # fmt: skip
    import torch.distributed as dist

    from plait.models.imagenet import build_imagenet_model

    torch.manual_seed(config.seed)
    model = build_imagenet_model(model_name, num_classes=10, width_mult=config.width_mult)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    share = config.batch_size // world
    pipe = _Pipeline(config.image_size, 256, config.seed + (rank if variant == "remedy" else 0))
    prefetch = _Prefetch(pipe, share) if variant == "remedy" else None
    rows = []
    for _ in range(config.warmup + config.steps):
        t0 = time.perf_counter()
        if prefetch is not None:
            x, y = prefetch.next()
        else:
            x, y = _scatter(pipe, rank, world, share, config)
        t1 = time.perf_counter()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]
        t2 = time.perf_counter()
        if world > 1:
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            flat = torch.cat([g.reshape(-1) for g in grads])
            wire = flat.half() if variant == "remedy" else flat
            dist.all_reduce(wire)
            flat.copy_(wire.float() / world)
            # the mean back into the gradients the optimizer steps with, as DDP leaves it
            for g, mean in zip(grads, torch.split(flat, [g.numel() for g in grads]), strict=True):
                g.copy_(mean.view_as(g))
        t3 = time.perf_counter()
        opt.step()
        reduce_s = t3 - t2 if world > 1 else 0.0  # one worker reduces nothing
        rows.append((t1 - t0, reduce_s, time.perf_counter() - t0))
    if prefetch is not None:
        prefetch.close()
    timed = rows[config.warmup :]
    step = statistics.median(r[2] for r in timed)
    return {"I": 100 * statistics.median(r[0] for r in timed) / step,
            "M": 100 * statistics.median(r[1] for r in timed) / step, "step_s": step,
            "replicas_agree": _replicas_agree(model, world)}  # fmt: skip


def _replicas_agree(model: torch.nn.Module, world: int) -> bool:
    """Whether every rank holds the same weights (each parameter's sum, bit for bit), as
    data parallelism that averages the gradients leaves them."""
    import torch.distributed as dist

    sums = torch.stack([p.detach().double().sum() for p in model.parameters()])
    if world == 1:
        return True
    low, high = sums.clone(), sums.clone()
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    return bool(torch.equal(low, high))


def _scatter(pipe: _Pipeline, rank: int, world: int, share: int,
             config: DataMovementConfig) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    import torch.distributed as dist

    x = torch.empty(share, 3, config.image_size, config.image_size)
    y = torch.empty(share, dtype=torch.int64)
    if rank == 0:
        images, labels = pipe.batch(config.batch_size)
        if world == 1:
            return images, labels
        dist.scatter(x, list(images.chunk(world)), src=0)
        dist.scatter(y, list(labels.chunk(world)), src=0)
    else:
        dist.scatter(x, None, src=0)
        dist.scatter(y, None, src=0)
    return x, y


class _Prefetch:
    """A background thread that builds this worker's next shard while the step computes."""

    def __init__(self, pipe: _Pipeline, share: int) -> None:
        self.pipe, self.share = pipe, share
        self.ready: tuple[torch.Tensor, torch.Tensor] | None = None
        self.thread = threading.Thread(target=self._fill)
        self.thread.start()

    def _fill(self) -> None:
        self.ready = self.pipe.batch(self.share)

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        self.thread.join()
        batch = self.ready
        assert batch is not None
        self.thread = threading.Thread(target=self._fill)
        self.thread.start()
        return batch

    def close(self) -> None:
        self.thread.join()


def measure_cell(config: DataMovementConfig, model: str, workers: int) -> dict[str, Any]:
    """One world of `workers` processes: baseline and remedies, rank 0's shares."""
    from plait.train import launch

    result: dict[str, Any] = launch(_worker, workers, config, model)[0]
    return result


def measure(config: DataMovementConfig, *, done: dict[str, Any] | None = None,
            save: Callable[[str, Any], None] | None = None,
            quiet: bool = False) -> dict[str, Any]:  # fmt: skip
    """Every (model, workers) cell; cells in `done` are kept (a resumed run)."""
    cells = dict(done or {})
    for model in config.models:
        for w in config.workers:
            key = f"{model}/{w}"
            if key in cells:
                continue
            cells[key] = measure_cell(config, model, w)
            if save:
                save(key, cells[key])
            if not quiet:
                b, r = cells[key]["base"], cells[key]["remedy"]
                print(f"data-movement: {key}: I {b['I']:.1f}% M {b['M']:.1f}% -> with remedies "
                      f"I {r['I']:.1f}% M {r['M']:.1f}%", file=sys.stderr, flush=True)  # fmt: skip
    return cells


def run_experiment(config: DataMovementConfig, setup: PaperSetup | None = None, *,
                   done: dict[str, Any] | None = None,
                   save: Callable[[str, Any], None] | None = None,
                   quiet: bool = False, train: bool = True) -> dict[str, Any]:  # fmt: skip
    """Measured here and predicted on the paper's GPUs, as one JSON-ready dict
    (`train` False: the prediction only, nothing measured)."""
    setup = setup or PaperSetup()
    measured = {} if not train else measure(config, done=done, save=save, quiet=quiet)
    return {"config": asdict(config), "measured": measured,
            "predicted": predict(setup, config.models)}  # fmt: skip
