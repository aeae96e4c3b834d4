"""The one place that decides which device a worker computes on and which backend it talks over.

Every other module asks here: which device kind a run uses (`resolve`, from `--device
auto|cpu|cuda`), how many workers a host can give one device each (`check_workers`), the
worker's own device (`worker_device`), the process-group backend for it (`backend_for`),
and what only the device knows: synchronising it, its memory, its random state, the
forward's autocast context and a synchronised clock for measurements.

The host's accelerator is read through `torch.accelerator` (torch >= 2.6), so a host is
asked once for its kind and count rather than through per-vendor calls scattered over the
code. plait runs on CPU workers (gloo) and on CUDA GPUs (NCCL); `auto` takes the
accelerator when there is one that torch.distributed has a backend for, else the CPU.
"""

from __future__ import annotations

import contextlib
import os
import resource
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import torch

__all__ = [
    "DEVICE_KINDS",
    "ActionClock",
    "accelerator",
    "accelerator_count",
    "autocast_context",
    "backend_for",
    "check_workers",
    "current",
    "default_workers",
    "deterministic",
    "device_ids",
    "device_name",
    "fork_rng",
    "fused_optimizers",
    "peak_memory_bytes",
    "profiler_activities",
    "release_memory",
    "reset_peak_memory",
    "resolve",
    "rng_state",
    "set_rng_state",
    "synchronize",
    "tf32",
    "timer",
    "total_memory_bytes",
    "worker_device",
]

#: The values of `--device`: `auto` takes the host's accelerator when it has one.
DEVICE_KINDS = ("auto", "cpu", "cuda")

_AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}


def accelerator() -> str | None:
    """The type of this host's accelerator that plait can train on ("cuda"), or None."""
    if not torch.accelerator.is_available():
        return None
    current = torch.accelerator.current_accelerator()
    kind = current.type if current is not None else None
    return kind if kind in DEVICE_KINDS and kind != "cpu" else None


def accelerator_count() -> int:
    """How many accelerators this process sees (0 without one; CUDA_VISIBLE_DEVICES counts)."""
    return int(torch.accelerator.device_count()) if accelerator() is not None else 0


def resolve(kind: str) -> str:
    """The device type a run with `--device kind` computes on: "cpu" or "cuda"."""
    if kind not in DEVICE_KINDS:
        raise ValueError(f"device={kind!r} is not one of {list(DEVICE_KINDS)}: use one of them")
    found = accelerator()
    if kind == "auto":
        return found or "cpu"
    if kind != "cpu" and found != kind:
        seen = f"this host's accelerator is {found}" if found else "no GPU is visible here"
        raise ValueError(
            f"device={kind!r} but {seen} (torch {torch.__version__}, CUDA "
            f"{torch.version.cuda or 'not built in'}): use --device cpu, or run on a host with "
            "a GPU and a CUDA build of torch"
        )
    return kind


def default_workers(kind: str) -> int | None:
    """The worker count a run on `--device kind` starts when none is given: one per visible
    GPU; None on the CPU (the layout decides)."""
    return accelerator_count() if resolve(kind) != "cpu" else None


def check_workers(nproc: int, kind: str, *, local: int | None = None) -> None:
    """Refuse `nproc` workers (`local` of them on this host; default all) on `--device kind`
    when the host has fewer GPUs than local workers: each worker needs a GPU of its own."""
    if resolve(kind) == "cpu":
        return
    here, count = local if local is not None else nproc, accelerator_count()
    if here > count:
        raise ValueError(
            f"{here} workers on this host but {count} GPU{'s' * (count != 1)} visible: each "
            f"worker needs its own GPU; use --nproc {count} (and a layout of {count} workers), "
            "or --device cpu to train on CPU workers"
        )


def backend_for(device: torch.device | str) -> str:
    """The torch.distributed backend for `device`'s type: NCCL on CUDA, gloo on the CPU."""
    kind = torch.device(device).type
    return "nccl" if kind == "cuda" else "gloo"


def worker_device(kind: str, local_rank: int) -> torch.device:
    """The device of the worker with `local_rank` on its host, made current for it."""
    resolved = resolve(kind)
    if resolved == "cpu":
        return torch.device("cpu")
    count = accelerator_count()
    if local_rank >= count:
        raise ValueError(
            f"local rank {local_rank} has no GPU of its own: this host shows {count}; start at "
            f"most {count} workers per host, or use --device cpu"
        )
    device = torch.device(resolved, local_rank)
    torch.accelerator.set_device_index(device)
    return device


def current() -> torch.device:
    """This worker's device when a caller names none: the GPU its process group talks
    NCCL from, else the CPU (a gloo group, or none)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.accelerator.current_device_index())
    return torch.device("cpu")


def deterministic(enabled: bool) -> None:
    """Make this process's kernels repeatable bit for bit (or not): torch's deterministic
    algorithms, and cuBLAS's fixed workspace, which must be set before its first call."""
    if enabled:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(enabled, warn_only=True)


def tf32(enabled: bool, device: torch.device) -> None:
    """Let fp32 matmuls and convolutions on a CUDA `device` run in TF32 (10-bit mantissa
    inputs, fp32 accumulation), or keep them in full fp32; nothing on other devices."""
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = enabled
        torch.backends.cudnn.allow_tf32 = enabled


def fused_optimizers(device: torch.device) -> bool:
    """Whether torch has fused optimizer kernels (AdamW, Adam, SGD `fused=True`) for
    `device`'s type: CUDA and CPU here."""
    from plait.compat import fused_optimizer_devices

    return device.type in fused_optimizer_devices()


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on `device` (nothing to wait for on the CPU)."""
    if device.type != "cpu" and device.type != "meta":
        torch.accelerator.synchronize(device)


def device_ids(device: torch.device) -> list[int] | None:
    """DistributedDataParallel's `device_ids` for a module on `device` (None on the CPU)."""
    return [device.index if device.index is not None else 0] if device.type != "cpu" else None


def timer(device: torch.device) -> Callable[[], float]:
    """A clock for measurements of work on `device`: seconds, after the device has finished
    what was queued (so a GPU's kernels are counted, not their launches)."""

    def now() -> float:
        synchronize(device)
        return time.perf_counter()

    return now


def profiler_activities(device: torch.device) -> list[torch.profiler.ProfilerActivity]:
    """What `torch.profiler` records for work on `device`: the host's operators, and on a
    GPU its kernels, on the GPU's own clock."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    return activities


def device_name(device: torch.device) -> str:
    """The product name of an accelerator `device` ("NVIDIA H100 80GB HBM3"), or "cpu"."""
    if device.type == "cuda":
        return str(torch.cuda.get_device_name(device))
    return device.type


class ActionClock:
    """Per-action times of a window without a host sync per action.

    `mark()` takes an instant: on the CPU the wall clock (`perf_counter`); on a GPU a CUDA
    event recorded on the current stream, whose time is when the GPU reaches it, i.e.
    when the kernels queued before it have run (so marks around an action's launches time
    its kernels, not the launches). `seconds(marks)` turns the window's marks into seconds
    since `start()`'s mark; on a GPU it waits for the last mark first, so call it after the
    step's one synchronisation (then it costs nothing). Marks are plain objects the caller
    keeps; the clock keeps only the window's start."""

    def __init__(self, device: torch.device) -> None:
        self.events = device.type == "cuda"
        self._start: Any = None

    def mark(self) -> Any:
        if not self.events:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        event.record()
        return event

    def start(self) -> Any:
        """Begin a window: its marks count from here."""
        self._start = self.mark()
        return self._start

    def seconds(self, marks: list[Any], start: Any = None) -> list[float]:
        """Seconds from `start` (default: the window's) to each of `marks`."""
        origin = self._start if start is None else start
        if not self.events:
            return [m - origin for m in marks]
        if marks:
            marks[-1].synchronize()
        return [origin.elapsed_time(m) / 1e3 for m in marks]


def total_memory_bytes(device: torch.device) -> int | None:
    """The memory of an accelerator `device`; None for the CPU (shared with the host)."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    return None


def peak_memory_bytes(device: torch.device) -> int:
    """The most memory this worker has held: the allocator's peak on a GPU, the process's
    peak resident size on the CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def release_memory(device: torch.device) -> None:
    """Hand the allocator's cached, unused blocks of a GPU `device` back (nothing on CPU)."""
    if device.type == "cuda":
        torch.cuda.empty_cache()


def reset_peak_memory(device: torch.device) -> None:
    """Start the allocator's peak afresh (a GPU; the CPU's peak cannot be reset)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    """This process's random state: the CPU generator's and, on a GPU, the device's."""
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, torch.Tensor] | torch.Tensor, device: torch.device) -> None:
    """Restore `rng_state`'s result (a bare tensor is a CPU state, as older checkpoints hold)."""
    if isinstance(state, torch.Tensor):
        torch.set_rng_state(state)
        return
    torch.set_rng_state(state["cpu"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


@contextlib.contextmanager
def fork_rng(device: torch.device) -> Iterator[None]:
    """Run the body and restore the random state of the CPU and of `device` afterwards."""
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        yield


def autocast_context(dtype: str, device: torch.device) -> Callable[[], AbstractContextManager[Any]]:
    """A factory of the forward's autocast context for the training `dtype` ("fp32": none):
    weights stay fp32 and matmuls run in bf16 or fp16, as training runs them."""
    if dtype not in _AUTOCAST:
        return contextlib.nullcontext
    return lambda: torch.autocast(device_type=device.type, dtype=_AUTOCAST[dtype])
