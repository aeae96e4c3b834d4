"""Measuring each gradient compression's encode + decode time per entry on this device.

The data-parallel reducer hands every bucket to a comm hook (`plait.parallel.compress`);
what the hook does besides its collectives (casting, PowerSGD's matmuls and
orthogonalisation, error feedback, selecting, packing and unpacking entries) is its
codec time, which the cost model charges per gradient entry (`Device.codec_s_per_entry`,
`plait.cost.compress.codec_time`). It is measured here by running the very hooks and
states `hook_for` gives the reducer, on buckets of square fp32 matrices of several sizes,
over a process group of one rank (gloo on CPU, NCCL on CUDA; created apart, so no
default group is needed), whose collectives copy at most. (The hooks are imported from
`plait.parallel` when measuring, against this package's place below it: the code timed
must be the code the reducer runs.) The time per entry is the slope of the fastest
call's seconds over the sizes (least squares, as `fit_link` fits a link),
which leaves out what a call costs whatever its size.

Inputs are chosen to behave like training: PowerSGD has passed its plain all-reduce
steps and warm-starts from its previous factors; `threshold:TAU` sees gradients of
standard deviation TAU/3.29, so that about `density` = 0.1% of entries reach ±TAU (the
cost model's default), with its residual cleared before each timed call.

Limits: one rank's payload is decoded, not every rank's; sparse methods decode each
rank's share (top-k and threshold: k entries each, small next to the N-entry passes;
sign: a pass over N per rank), so their figures are low by that much at large dp.
PowerSGD's cost per entry depends on its matrices' shapes (here 256 × 256) and
threshold's on the share of entries it sends.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import platform
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from plait.cluster import Cluster
from plait.compression import DEFAULT_CODECS, parse_compression
from plait.device import backend_for, timer
from plait.profile.calibrate import fit_link

__all__ = [
    "DEFAULT_CODECS",
    "cached_codec_costs",
    "measure_codec",
    "read_codec_profile",
    "with_codec",
]

_SIDE = 256  # the matrices' side: a bucket of k matrices holds k · 256² entries
_MATRICES = (2, 4, 8, 16)  # bucket sizes measured, in matrices (128 Ki to 1 Mi entries)
_DENSITY_SIGMAS = 3.29  # P(|x| >= 3.29 σ) = 0.1% for a normal x
_VERSION = 1


def _one_rank_group(device: torch.device) -> Any:
    """A process group of this process alone (not registered as the default group)."""
    import torch.distributed as dist

    store = dist.HashStore()  # type: ignore[attr-defined]
    timeout = datetime.timedelta(seconds=60)
    if backend_for(device) == "nccl":
        return dist.ProcessGroupNCCL(store, 0, 1, dist.ProcessGroupNCCL.Options())
    return dist.ProcessGroupGloo(store, 0, 1, timeout)


def _bucket(num_matrices: int, scale: float, device: torch.device, seed: int) -> Any:
    from plait.parallel.compress import HookBucket

    g = torch.Generator().manual_seed(seed)
    flat = (torch.randn(num_matrices * _SIDE * _SIDE, generator=g) * scale).to(device)
    shapes = [torch.Size([_SIDE, _SIDE])] * num_matrices
    return HookBucket(0, flat, shapes, [], last=True)


def _seconds(
    method: str, num_matrices: int, group: Any, *, device: torch.device,
    warmup: int, repeats: int,
) -> float:  # fmt: skip
    """Seconds of one hook call on a bucket of `num_matrices` matrices: the fastest of
    `repeats` (the least disturbed by other work on a shared machine)."""
    from plait.parallel.compress import ErrorFeedback, hook_for

    c = parse_compression(method)
    made = hook_for(c, group)
    assert made is not None, "none has no codec"
    hook, state = made
    scale = float(c.value or 1.0) / _DENSITY_SIGMAS if c.method == "threshold" else 1.0
    clock = timer(device)
    times = []
    # PowerSGD all-reduces plainly for its first 2 steps, then allocates its factors
    for i in range(warmup + repeats + (3 if c.method == "powersgd" else 0)):
        bucket = _bucket(num_matrices, scale, device, seed=i)
        if isinstance(state, ErrorFeedback):
            for residual in state.residuals.values():
                residual.zero_()
        start = clock()
        hook(state, bucket).wait()
        seconds = clock() - start
        times.append(seconds)
    return min(times[-repeats:])


def measure_codec(
    methods: Sequence[str] = DEFAULT_CODECS,
    *,
    device: torch.device | str = "cpu",
    warmup: int = 1,
    repeats: int = 5,
    matrices: Sequence[int] = _MATRICES,
) -> dict[str, float]:
    """Seconds per gradient entry of each method's encode + decode on `device`, by
    `--compress` value: the slope of a hook call's median time over buckets of
    `matrices` 256 × 256 fp32 matrices each."""
    if warmup < 0 or repeats < 1:
        raise ValueError(f"warmup={warmup} must be >= 0 and repeats={repeats} >= 1")
    if len(set(matrices)) < 2:
        raise ValueError(f"matrices={tuple(matrices)}: measure at least two bucket sizes")
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    # in a process of its own: the one-rank gloo group lives and dies there (a gloo group
    # torn down in a process that goes on, as a test runner does, can abort it later)
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=1, mp_context=context) as pool:
        args = (tuple(methods), str(device), warmup, repeats, tuple(matrices))
        return pool.submit(_measure, *args, threads=torch.get_num_threads()).result()


def _measure(
    methods: Sequence[str], device: str, warmup: int, repeats: int, matrices: Sequence[int],
    *, threads: int,
) -> dict[str, float]:  # fmt: skip
    torch.set_num_threads(threads)  # this process's, as the caller measures
    where = torch.device(device)
    group = _one_rank_group(where)
    out = {}
    for method in methods:
        c = parse_compression(method)
        if c.method == "none":
            continue
        samples = [
            (float(k * _SIDE * _SIDE), _seconds(str(c), k, group, device=where,
                                                warmup=warmup, repeats=repeats))
            for k in matrices
        ]  # fmt: skip
        slope = 1.0 / fit_link(samples).bandwidth_Bps  # seconds per entry
        # noise can flatten the fit to nothing: then the largest bucket's mean, an upper
        # bound (it includes what a call costs whatever its size)
        out[str(c)] = slope if slope > 1e-14 else samples[-1][1] / samples[-1][0]
    return out


def _cache_key(methods: Sequence[str], device: torch.device, repeats: int) -> dict[str, Any]:
    return {
        "version": _VERSION,
        "kind": "codec",
        "methods": [str(parse_compression(m)) for m in methods],
        "device": str(device),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "machine": f"{platform.node()} {platform.machine()} {platform.processor()}",
        "repeats": repeats,
    }


def cached_codec_costs(
    methods: Sequence[str] = DEFAULT_CODECS,
    *,
    device: torch.device | str = "cpu",
    repeats: int = 3,
    cache_dir: Path | None,
) -> tuple[dict[str, float], bool]:
    """`measure_codec`, read from `cache_dir` when measured there before on this machine,
    device, thread count and torch (`cache_dir` None: measure, keep nothing). Returns the
    figures and whether they came from the cache."""
    where = torch.device(device)
    key = _cache_key(methods, where, repeats)
    path = None
    if cache_dir is not None:
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]
        path = cache_dir / f"codec-{digest}.json"
        try:
            data = json.loads(path.read_text())
            if data["key"] == key:
                return {str(k): float(v) for k, v in data["codec_s_per_entry"].items()}, True
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            pass  # missing or unreadable: measure again
    figures = measure_codec(methods, device=where, repeats=repeats)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps({"key": key, "codec_s_per_entry": figures}, indent=1))
        tmp.replace(path)  # atomic, as the block cache
    return figures, False


def read_codec_profile(path: str | Path) -> dict[str, float]:
    """The codec figures of a profile `plait profile --json` wrote (`device` →
    `codec_s_per_entry`); empty for a profile without them (analytic, or older)."""
    file = Path(path)
    try:
        data = json.loads(file.read_text())
    except OSError as err:
        raise ValueError(f"--profile {path}: cannot read it ({err.strerror})") from None
    except ValueError:
        raise ValueError(
            f"--profile {path} is not JSON: write one with `plait profile --json > {path}`"
        ) from None
    device = data.get("device", {}) if isinstance(data, dict) else None
    figures = device.get("codec_s_per_entry", {}) if isinstance(device, dict) else None
    if not isinstance(figures, Mapping):
        raise ValueError(f"--profile {path}: device.codec_s_per_entry must map methods to seconds")
    return {str(k): float(v) for k, v in figures.items()}


def with_codec(cluster: Cluster, figures: Mapping[str, float]) -> Cluster:
    """`cluster` with every device carrying the measured codec `figures` (nothing changes
    when there are none)."""
    if not figures:
        return cluster
    groups = tuple(
        replace(g, device=replace(g.device, codec_s_per_entry=dict(figures)))
        for g in cluster.groups
    )
    return replace(cluster, groups=groups)
