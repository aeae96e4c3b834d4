"""Seed 001's Tables 3 and 4 predicted at the paper's scale: the simulator replays one
step of data parallelism and of a GPipe pipeline of ResNet-18 on A100s.

Seed 001 (§4) trained a CIFAR ResNet-18 on CIFAR-100 for 10 epochs on 2, 4, 6 and 8 A100s of
one DGX node (ThetaGPU), once with Horovod data parallelism and once with torchgpipe
(layers balanced by measured time, batches cut into micro-batches), in fp32 (Table 3) and
with apex O3 fp16 (Table 4; the seed's Table 4 repeats Table 3's numbers). The GPipe runs
took 4-20× the data-parallel times.

The simulator replays one step of each layout on the cluster file (`dgx-a100-80gb` by
default) with block costs counted from the full-width model (`plait.experiment.work`); the
paper's software adds host-side costs the cluster file does not describe, stated in
`PaperSetup`: one input pipeline per process (Horovod runs one per GPU, torchgpipe one for
all), and the Python dispatch of every operator, which the simulator charges itself
(`Device.dispatch_s`: the counted operators per block × `PaperSetup.dispatch_s`; each
action lasts at least its issue, and torchgpipe's single process issues every stage's
actions on one host timeline, `SimPlan.single_process`). A step takes the longer of the
simulated step and the input pipeline, as a prefetching loader overlaps them. Beside the
paper's two methods it predicts plait's own schedules on the same GPUs and the layout
plait's planner picks.
Limits: the seed gives neither batch size nor chunk count nor loader settings; the values
in `PaperSetup` are stated assumptions, printed with every prediction.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from plait.cluster import Cluster
from plait.cost import BlockCost, Recompute, StageCost, stage_costs
from plait.experiment.work import BlockWork, block_costs, count_work, median_abs_error
from plait.experiment.work import relative_error as _err
from plait.presets import load_cluster
from plait.profile.dispatch import with_dispatch
from plait.sim import SimPlan, build_schedule, simulate

__all__ = [
    "METHODS",
    "PUBLISHED",
    "PaperSetup",
    "block_dispatch_s",
    "implied_task_s",
    "predict",
    "predict_cell",
]

# Seed 001, Table 3 (fp32; Table 4, fp16, prints the same numbers): per GPU count,
# (accuracy %, seconds) of DDP and of GPipe over 10 epochs of CIFAR-100.
PUBLISHED: dict[str, dict[int, tuple[float, float]]] = {
    "ddp": {2: (69.856, 256.83), 4: (69.025, 120.24), 6: (70.397, 83.01), 8: (68.146, 58.22)},
    "gpipe": {2: (67.25, 1169.12), 4: (66.85, 907.39), 6: (67.22, 1067.43), 8: (67.71, 1148.52)},
}
METHODS = ("ddp", "gpipe")
_CIFAR_TRAIN = 50_000


@dataclass(frozen=True, kw_only=True)
class PaperSetup:
    """The paper's run as the simulator sees it: what the cluster file holds, plus the
    assumptions about the software the seed does not state."""

    cluster: str = "dgx-a100-80gb"
    gpus: tuple[int, ...] = (2, 4, 6, 8)
    images: int = _CIFAR_TRAIN
    epochs: int = 10
    batch_size: int = 128  # assumed: the usual CIFAR recipe; the seed does not say
    chunks: int = 8  # assumed torchgpipe chunk count (micro-batches per batch)
    # assumed: torchvision's per-image PIL transforms (crop, flip, to-tensor, normalise)
    # in a loader feeding one process, samples per second
    loader_samples_per_s: float = 1000.0
    dispatch_s: float = 10e-6  # assumed: host time to dispatch one eager aten operator
    # host time of each (micro-batch, stage) task in torchgpipe beyond dispatching its
    # operators (thread hand-off, stream waits, checkpoint bookkeeping): not assumed (0);
    # `predict` reports the value that would reproduce each published GPipe time
    task_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("images", "epochs", "batch_size", "chunks"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if not (self.loader_samples_per_s > 0 and math.isfinite(self.loader_samples_per_s)):
            raise ValueError(f"loader_samples_per_s={self.loader_samples_per_s} (--loader-rate) "
                             "must be a positive number of samples per second")  # fmt: skip
        for name in ("dispatch_s", "task_s"):
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"{name}={value} must be >= 0 seconds")
        if not self.gpus or min(self.gpus) < 1:
            raise ValueError(f"gpus={list(self.gpus)}: give GPU counts >= 1")

    @property
    def steps(self) -> int:
        return self.epochs * math.ceil(self.images / self.batch_size)


def _setup_work(width: int = 64) -> list[BlockWork]:
    import torch

    from plait.models.resnet import ResNet18

    with torch.device("meta"):  # counted only: no weights needed
        model = ResNet18(width=width, num_classes=100)
    return count_work(model, (3, 32, 32))


def _gpu_step(cluster: Cluster, plan: SimPlan, stages: Sequence[StageCost]) -> float:
    return simulate(build_schedule(plan), list(stages), cluster, plan).step_time_s


def _balanced(cluster: Cluster, blocks: Sequence[Any], pp: int, dtype: str) -> list[StageCost]:
    from plait.plan.partition import partition_blocks

    devices = [cluster.device(r) for r in range(pp)]
    part = partition_blocks(list(blocks), devices, dtype=dtype, optimizer="sgd")
    return stage_costs(list(blocks), part.boundaries)


def block_dispatch_s(work: Sequence[BlockWork], per_op_s: float) -> float:
    """Host seconds to issue one block's forward or backward (`Device.dispatch_s`): the
    model's counted operators of a forward and a backward, averaged over its blocks and
    the two passes, at `per_op_s` each."""
    return per_op_s * sum(w.ops for w in work) / (2 * len(work))


def predict_cell(
    cluster: Cluster, setup: PaperSetup, work: Sequence[BlockWork], *, method: str,
    gpus: int, dtype: str, schedule: str | None = None, chunks: int = 1,
) -> dict[str, Any]:  # fmt: skip
    """Seconds of the paper's run of `method` on `gpus` GPUs, with the parts of a step:
    the simulated step (GPU work, each action at least its host issue time, all stages'
    issue serialised on one host for torchgpipe), the input pipeline, and the host time."""
    b = setup.batch_size
    dispatch = block_dispatch_s(work, setup.dispatch_s)
    cluster = with_dispatch(cluster, dispatch)
    dev = cluster.device(0)
    if method == "ddp":
        mbs = max(1, b // gpus)
        plan = SimPlan(dp=gpus, schedule="gpipe", microbatches=1, micro_batch_size=mbs,
                       dtype=dtype, optimizer="sgd")  # fmt: skip
        stages = [StageCost(tuple(block_costs(work, dev, dtype, mbs)))]
        loader, host = mbs / setup.loader_samples_per_s, 2 * len(work) * dispatch
    else:
        m, kind = setup.chunks, schedule or "gpipe"
        mbs = max(1, b // m)
        recompute: Recompute = "full" if kind == "gpipe" else "none"  # torchgpipe checkpoints
        # torchgpipe runs one process for every stage; plait a process per stage
        plan = SimPlan(pp=gpus, schedule=kind, microbatches=m, micro_batch_size=mbs,
                       chunks=chunks, dtype=dtype, optimizer="sgd", recompute=recompute,
                       single_process=schedule is None)  # fmt: skip
        stages = _balanced(cluster, block_costs(work, dev, dtype, mbs), gpus * chunks, dtype)
        if setup.task_s > 0 and schedule is None:
            stages = [_with_task(stage, setup.task_s * dev.achievable_flops(dtype))
                      for stage in stages]  # fmt: skip
        loader = b / setup.loader_samples_per_s
        passes = 3 if recompute == "full" else 2
        share = len(work) if schedule is None else max(len(st.blocks) for st in stages)
        host = m * passes * share * dispatch
    gpu = _gpu_step(cluster, plan, stages)
    step = max(gpu, loader)
    bound = "input" if step == loader else "host" if gpu <= host * (1 + 1e-9) else "gpu"
    return {"seconds": step * setup.steps, "step_s": step, "gpu_step_s": gpu,
            "loader_step_s": loader, "host_step_s": host, "bound": bound}  # fmt: skip


def _with_task(stage: StageCost, flops: float) -> StageCost:
    """`stage` with a fixed cost added to each of its forward and backward actions (first,
    so the stage still sends its last block's activation)."""
    task = BlockCost(name="host-task", forward_flops=flops, backward_input_flops=flops)
    return StageCost((task, *stage.blocks))


def implied_task_s(cluster: Cluster, setup: PaperSetup, work: Sequence[BlockWork], *,
                   gpus: int, dtype: str, seconds: float) -> float | None:  # fmt: skip
    """The host time per (micro-batch, stage) task under which the simulated GPipe run
    takes `seconds` (bisection: the step grows with it); None when even none is too slow."""

    def run(task_s: float) -> float:
        cell = predict_cell(cluster, replace(setup, task_s=task_s), work, method="gpipe",
                            gpus=gpus, dtype=dtype)  # fmt: skip
        return float(cell["seconds"])

    lo, hi = 0.0, 0.1  # a tenth of a second per task: far beyond any published time
    if run(lo) >= seconds or run(hi) < seconds:
        return None
    for _ in range(24):  # to 6 ns
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if run(mid) < seconds else (lo, mid)
    return (lo + hi) / 2


def predict(setup: PaperSetup, dtypes: Sequence[str] = ("fp32", "fp16"),
            cluster: Cluster | None = None) -> dict[str, Any]:  # fmt: skip
    """The paper's tables as the simulator predicts them, beside the published numbers."""
    cluster = cluster or load_cluster(setup.cluster)
    work = _setup_work()
    tables: dict[str, Any] = {}
    for dtype in dtypes:
        rows = []
        for g in setup.gpus:
            row: dict[str, Any] = {"gpus": g}
            for method in METHODS:
                cell = predict_cell(cluster, setup, work, method=method, gpus=g, dtype=dtype)
                published = PUBLISHED[method].get(g)
                cell["published_s"] = published and published[1]
                cell["published_accuracy"] = published and published[0]
                cell["error"] = _err(cell["seconds"], cell["published_s"])
                row[method] = cell
            if published := PUBLISHED["gpipe"].get(g):
                row["gpipe"]["implied_task_s"] = implied_task_s(
                    cluster, setup, work, gpus=g, dtype=dtype, seconds=published[1]
                )
            row["plait"] = _alternatives(cluster, setup, work, g, dtype)
            rows.append(row)
        tables[dtype] = {
            "rows": rows,
            "median_error": {m: median_abs_error([r[m]["error"] for r in rows]) for m in METHODS},
            "task_fit": _task_fit(cluster, setup, work, rows, dtype),
        }
    return {"setup": asdict(setup), "cluster": cluster.name, "tables": tables,
            "findings": _findings(tables, setup)}  # fmt: skip


def _alternatives(cluster: Cluster, setup: PaperSetup, work: Sequence[BlockWork], gpus: int,
                  dtype: str) -> dict[str, Any]:  # fmt: skip
    """plait's schedules on the same GPUs: one process per stage (no single dispatching
    host), the same input pipeline feeding the first stage; and the planner's pick."""
    out: dict[str, Any] = {}
    for name, kind, chunks in (("1f1b", "1f1b", 1), ("interleaved", "interleaved", 2)):
        if gpus * chunks > len(work) or setup.chunks < gpus:
            out[name] = None
            continue
        cell = predict_cell(cluster, setup, work, method="pp", gpus=gpus, dtype=dtype,
                            schedule=kind, chunks=chunks)  # fmt: skip
        out[name] = cell["seconds"]
    out["planner"] = _planner_pick(cluster, setup, work, gpus, dtype)
    return out


def _planner_pick(cluster: Cluster, setup: PaperSetup, work: Sequence[BlockWork], gpus: int,
                  dtype: str) -> dict[str, Any] | None:  # fmt: skip
    from plait.plan.search import describe, search
    from plait.plan.space import ModelSpec, SearchSpace

    cluster = with_dispatch(cluster, block_dispatch_s(work, setup.dispatch_s))
    dev = cluster.device(0)

    def costs(mbs: int, layout: object) -> list[Any]:
        return block_costs(work, dev, dtype, mbs)

    spec = ModelSpec(name="resnet18", num_blocks=len(work), seq_len=1, num_heads=1, costs=costs)
    space = SearchSpace(dtype=dtype, optimizer="sgd", recompute=("none",), zero_stages=(0,),
                        sequence_parallel=(False,),
                        micro_batch_sizes=(2, 4, 8, 16, 32, 64, 128))  # fmt: skip
    try:
        # the search waits for the input: each data-parallel replica's first stage reads
        # that replica's batch through its own loader
        found = search(spec, cluster, global_batch=setup.batch_size, num_devices=gpus,
                       space=space, top_k=1,
                       loader_samples_per_s=setup.loader_samples_per_s)  # fmt: skip
    except ValueError:
        return None
    best = found.best
    # the simulator charges each rank's host issue (one process per rank) within the step
    bound = "input" if best.input_bound else "gpu"
    return {"plan": describe(best.plan), "seconds": best.step_time_s * setup.steps,
            "bound": bound}  # fmt: skip


def _task_fit(cluster: Cluster, setup: PaperSetup, work: Sequence[BlockWork],
              rows: list[dict[str, Any]], dtype: str) -> dict[str, Any] | None:  # fmt: skip
    """One host cost per task for every GPU count (the median of the implied ones): a
    one-parameter fit, which says whether the model's shape over GPU counts holds."""
    implied = [r["gpipe"].get("implied_task_s") for r in rows]
    task_s = median_abs_error(implied)
    if task_s is None:
        return None
    fitted = replace(setup, task_s=task_s)
    seconds, errors = [], []
    for r in rows:
        cell = predict_cell(cluster, fitted, work, method="gpipe", gpus=r["gpus"], dtype=dtype)
        seconds.append(cell["seconds"])
        errors.append(_err(cell["seconds"], r["gpipe"]["published_s"]))
    return {"task_s": task_s, "seconds": seconds, "errors": errors,
            "median_error": median_abs_error(errors)}  # fmt: skip


def _findings(tables: dict[str, Any], setup: PaperSetup) -> list[str]:
    table = next(iter(tables.values()))
    rows, fit = table["rows"], table["task_fit"]
    out = []
    for row in rows:
        d, g = row["ddp"], row["gpipe"]
        ratio = g["seconds"] / d["seconds"]
        pub = (
            (g["published_s"] / d["published_s"]) if g["published_s"] and d["published_s"] else None
        )
        out.append(
            f"{row['gpus']} GPUs: GPipe/DDP predicted {ratio:.1f}× (published "
            f"{'-' if pub is None else f'{pub:.1f}×'}); DDP step bound by {d['bound']} "
            f"(GPU {d['gpu_step_s'] * 1e3:.1f} ms, input {d['loader_step_s'] * 1e3:.1f} ms), "
            f"GPipe by {g['bound']} (GPU {g['gpu_step_s'] * 1e3:.1f} ms with "
            f"{setup.chunks} micro-batches and recomputation, input "
            f"{g['loader_step_s'] * 1e3:.1f} ms, host dispatch {g['host_step_s'] * 1e3:.1f} ms)"
        )
    implied = [r["gpipe"].get("implied_task_s") for r in rows]
    if fit is not None:
        shown = ", ".join("-" if t is None else f"{t * 1e3:.1f}" for t in implied)
        out.append(
            f"the published GPipe times need {shown} ms of host time per (micro-batch, stage) "
            f"task on {', '.join(str(r['gpus']) for r in rows)} GPUs; one value for all "
            f"({fit['task_s'] * 1e3:.1f} ms, a one-parameter fit) gives "
            f"{', '.join(f'{x:.0f}' for x in fit['seconds'])} s (median error "
            f"{100 * fit['median_error']:.0f}%)"
        )
    return out
