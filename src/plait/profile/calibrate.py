"""Calibrating the cost model's device and link numbers from measurements on this machine.

`matmul_flops` times a square matmul with torch (with as many intra-op threads as the
workers use, one by default); `optimizer_bandwidth` times an optimizer step and turns it
into the memory bandwidth `plait.cost.optimizer_step_time` assumes; `fit_link` fits the
alpha-beta model (Hockney, "The communication challenge for MPP", 1994) to measured
(bytes, seconds) pairs, such as a gloo ping-pong between two local workers;
`measured_device` puts them together into a `Device`. Two measurements run inside
workers that have joined a process group (the launcher's, gloo on CPU): `pingpong`
samples the link between ranks 0 and 1, and `message_overheads` the time a rank's own
thread spends posting a send or a receive while ranks compute between messages, which on
an oversubscribed CPU is a scheduler time slice rather than the microseconds of an idle
machine (the communication library's thread must get a core).

Limits: one matmul size stands for every GEMM (small blocks run below that rate, which
the profiler's seconds capture but a FLOP-based MFU does not); the link fit is least
squares on a handful of sizes; the overheads are medians of one message size.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Iterator, Sequence

import torch
from torch import nn

from plait.cluster import Device, Link, normalize_dtype
from plait.device import current, timer

__all__ = [
    "fit_link",
    "matmul_flops",
    "measured_device",
    "message_overheads",
    "optimizer_bandwidth",
    "pingpong",
    "posting_s",
    "threads",
]


@contextlib.contextmanager
def threads(count: int | None) -> Iterator[None]:
    """Run the body with `count` torch intra-op threads (None: leave as is), then restore."""
    before = torch.get_num_threads()
    if count is not None:
        if count < 1:
            raise ValueError(f"threads={count} must be >= 1")
        torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def matmul_flops(
    *,
    dtype: torch.dtype = torch.float32,
    size: int = 512,
    repeats: int = 5,
    num_threads: int | None = 1,
    device: torch.device | str = "cpu",
) -> float:
    """FLOP/s of a `size`³ matmul in `dtype` on `device` (median of `repeats`)."""
    a = torch.randn(size, size, device=device).to(dtype)
    now = timer(torch.device(device))
    times = []
    with threads(num_threads), torch.no_grad():
        for i in range(repeats + 1):  # the first one warms up
            start = now()
            a @ a
            if i:
                times.append(now() - start)
    return 2.0 * size**3 / max(statistics.median(times), 1e-12)


def optimizer_bandwidth(
    params: Sequence[nn.Parameter],
    *,
    optimizer: str = "adam",
    repeats: int = 5,
    bytes_per_param: float = 24.0,
) -> float:
    """Bytes/s that makes `plait.cost.optimizer_step_time` match a measured step of
    `optimizer` over `params`: bytes_per_param × parameters / median step seconds (24
    bytes for fp32 Adam: gradient and two moments read, moments and weight written)."""
    if not params:
        raise ValueError("no parameters to step: give the model's parameters")
    for p in params:
        p.grad = torch.zeros_like(p)
    if optimizer == "adam":
        opt: torch.optim.Optimizer = torch.optim.Adam(params, lr=1e-3)
    elif optimizer == "sgd":
        opt = torch.optim.SGD(params, lr=1e-3, momentum=0.9)
    else:
        raise ValueError(f"optimizer={optimizer!r} is unknown; use 'adam' or 'sgd'")
    times = []
    with torch.no_grad():
        for i in range(repeats + 1):
            start = time.perf_counter()
            opt.step()
            if i:
                times.append(time.perf_counter() - start)
    for p in params:
        p.grad = None
    count = sum(p.numel() for p in params)
    return bytes_per_param * count / max(statistics.median(times), 1e-12)


def fit_link(samples: Sequence[tuple[float, float]]) -> Link:
    """The alpha-beta link that fits (bytes, seconds) samples best (least squares). Where
    noise leaves the times no slope (small messages as slow as large ones: the link moves
    the largest in its latency), the bandwidth is the one bound the times give, the largest
    message's time all spent moving it; where the line leaves no latency, it is what the
    smallest message's time leaves of it. A finite link either way, not the unbounded one
    a clamped slope made (1000 GB/s between two processes on one host)."""
    if len(samples) < 2 or len({b for b, _ in samples}) < 2:
        raise ValueError(f"{len(samples)} samples: measure at least two different sizes")
    xs = [float(b) for b, _ in samples]
    ys = [float(s) for _, s in samples]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    latency = my - slope * mx
    flat = slope <= 0
    if flat:
        largest = max(range(len(xs)), key=xs.__getitem__)
        slope = max(ys[largest], 1e-12) / xs[largest]  # seconds per byte
    if flat or latency < 0:
        smallest = min(range(len(xs)), key=xs.__getitem__)
        latency = max(ys[smallest] - slope * xs[smallest], 0.0)
    return Link(latency_s=latency, bandwidth_Bps=1.0 / slope)


def measured_device(
    *,
    name: str,
    flops: float,
    dtype: str = "fp32",
    memory_bytes: int,
    memory_bandwidth_Bps: float = 1e10,
) -> Device:
    """A device that does `flops` FLOP/s in `dtype` (efficiency 1: the rate is measured)."""
    return Device(
        name=name,
        peak_flops={normalize_dtype(dtype): flops},
        efficiency=1.0,
        memory_bytes=memory_bytes,
        memory_bandwidth_Bps=memory_bandwidth_Bps,
    )


def pingpong(
    rank: int,
    *,
    sizes: Sequence[int] = (1 << 10, 1 << 14, 1 << 16, 1 << 18),
    repeats: int = 15,
    device: torch.device | None = None,
) -> list[tuple[float, float]]:
    """Ranks 0 and 1 of the default process group bounce each size between buffers on
    their `device` (default: the worker's, `plait.device.current`); every rank must call
    it. Returns (bytes, median one-way seconds) pairs for `fit_link` (the same on all)."""
    import torch.distributed as dist

    device = device or current()
    now = timer(device)
    samples = []
    for size in sizes:
        buf = torch.zeros(max(1, size // 4), device=device)
        times = []
        for i in range(repeats + 2):
            dist.barrier()
            start = now()
            if rank in (0, 1):
                (dist.send, dist.recv)[rank](buf, 1 - rank)
                (dist.recv, dist.send)[rank](buf, 1 - rank)
            if i >= 2:
                times.append((now() - start) / 2)
        samples.append((float(size), statistics.median(times)))
    return samples


def message_overheads(
    rank: int,
    ranks: int,
    *,
    num_bytes: int,
    busy_s: float = 4e-3,
    repeats: int = 30,
    device: torch.device | None = None,
) -> tuple[float, float]:
    """Median seconds this rank's thread spends in `isend` and in posting `irecv` of
    `num_bytes`, as a pipeline does them: the first `ranks` ranks pair up (0→1, 2→3, ...),
    the sender sends after computing `busy_s`, the receiver posts, computes `busy_s`, then
    waits. Every rank of the default group must call it; returns (send, receive) seconds,
    0.0 for what this rank did not do. The messages live on `device` (default: the
    worker's); the compute between them is the CPU's, whose time slices this measures."""
    import torch.distributed as dist

    a, buf = torch.randn(128, 128), torch.zeros(max(1, num_bytes // 4), device=device or current())
    sender, peer = rank % 2 == 0, rank + 1 if rank % 2 == 0 else rank - 1
    sends, receives, works = [], [], []
    dist.barrier()
    for _ in range(repeats if peer < ranks and rank < ranks else 0):
        if sender:
            _compute(a, busy_s)
            start = time.perf_counter()
            works.append(dist.isend(buf, peer))
            sends.append(time.perf_counter() - start)
        else:
            start = time.perf_counter()
            work = dist.irecv(buf, peer)
            receives.append(time.perf_counter() - start)
            _compute(a, busy_s)
            if work is not None:
                work.wait()
    for pending in works:
        if pending is not None:
            pending.wait()
    dist.barrier()
    return tuple(statistics.median(x) if x else 0.0 for x in (sends, receives))  # type: ignore[return-value]


def posting_s(num_bytes: int, *, device: torch.device | None = None) -> float:
    """Seconds a worker's computing thread spends posting one message of `num_bytes` (a
    send or a receive, between compute, `message_overheads`): the median over the ranks
    that posted, every rank's answer alike (`Device.message_s`). Collective."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    if world < 2:
        return 0.0
    mine = message_overheads(rank, world - world % 2, num_bytes=num_bytes, device=device)
    everyone: list[tuple[float, float]] = [(0.0, 0.0)] * world
    dist.all_gather_object(everyone, mine)
    posted = [t for pair in everyone for t in pair if t > 0]
    return statistics.median(posted) if posted else 0.0


def _compute(a: torch.Tensor, seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        a @ a
