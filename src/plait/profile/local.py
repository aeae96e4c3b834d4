"""This host's devices as the cost model needs them, measured: matmul FLOP/s per dtype, memory,
and the link between two of its GPUs.

`plait profile` reports them and `--plan auto` plans on them, so a plan for the local
machine rests on what it does rather than on a preset's nominal figures. A GPU's rate is
timed on a large square matmul (8192², where a GPU reaches its sustained rate; fp32 with
TF32 as torch is set), a CPU's on 512² with the workers' one intra-op thread. The link is
timed by copying buffers from one GPU to the next (NVLink or PCIe, as the host routes it)
and fitted to the alpha-beta model; with one GPU, or on CPU workers, there is no device
link to measure (CPU workers' gloo links are measured by the workers themselves,
`plait.train.planinputs.measure_collectives`).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from plait.cluster import LOCAL, Cluster, Link, local_cpu, measured_cluster
from plait.device import accelerator_count, device_name, resolve, timer, total_memory_bytes
from plait.profile.calibrate import fit_link, matmul_flops

__all__ = ["LocalDevices", "device_link", "measure_local"]

_TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class LocalDevices:
    """The devices one host trains on: `count` alike, each doing `flops[dtype]` FLOP/s with
    `memory_bytes` of its own, joined by `link` (None: not measured, one device)."""

    name: str
    device_type: str
    count: int
    flops: dict[str, float]
    memory_bytes: int
    link: Link | None = None

    def cluster(self) -> Cluster:
        """The host as a one-node cluster for the planner and the simulator."""
        return measured_cluster(
            name=f"local-{self.device_type}",
            flops=self.flops,
            memory_bytes=self.memory_bytes,
            devices_per_node=self.count,
            intra_node=self.link or LOCAL,
        )

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["link"] = asdict(self.link) if self.link is not None else None
        return out


def device_link(
    source: torch.device,
    target: torch.device,
    *,
    sizes: Sequence[int] = (1 << 16, 1 << 20, 1 << 24, 1 << 26),
    repeats: int = 5,
) -> Link:
    """The alpha-beta link of copies from `source` to `target` (two GPUs of this host)."""
    now = timer(source)
    samples = []
    for size in sizes:
        a = torch.empty(size, dtype=torch.uint8, device=source)
        b = torch.empty(size, dtype=torch.uint8, device=target)
        times = []
        for i in range(repeats + 1):  # the first one warms the path up
            start = now()
            b.copy_(a)
            timer(target)()
            if i:
                times.append(now() - start)
        samples.append((float(size), statistics.median(times)))
    return fit_link(samples)


def measure_local(
    device: str = "auto",
    *,
    dtypes: Sequence[str] = ("fp32", "bf16", "fp16"),
    num_threads: int | None = 1,
    repeats: int = 5,
) -> LocalDevices:
    """Measure this host's devices of `--device device` (see the module docstring)."""
    kind = resolve(device)
    if kind == "cpu":
        where = torch.device("cpu")
        count = 1
        cpu = local_cpu(devices=1).device(0)
        name, memory = f"cpu ({num_threads or torch.get_num_threads()} thread)", cpu.memory_bytes
        size = 512
    else:
        where, count = torch.device(kind, 0), accelerator_count()
        name = device_name(where)
        memory = int(total_memory_bytes(where) or 0)
        size = 8192
    flops = {}
    for d in dtypes:
        flops[d] = matmul_flops(dtype=_TORCH_DTYPES[d], size=size, repeats=repeats,
                                num_threads=num_threads, device=where)  # fmt: skip
    link = device_link(where, torch.device(kind, 1)) if kind != "cpu" and count > 1 else None
    return LocalDevices(name, kind, count, flops, memory, link)
