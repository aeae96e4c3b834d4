"""Device selection and its errors, on a host with no GPU and on mocked GPU hosts."""

from __future__ import annotations

import contextlib
import subprocess
import sys

import pytest
import torch

from plait import device as dev
from plait.config import DEVICES


@pytest.fixture
def gpus(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A host with `gpus[0]` CUDA devices, as torch.accelerator reports it (set the count
    by assigning `gpus[0]`); the devices made current are recorded in gpus[1:]."""
    state = [2]
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: state[0] > 0)
    monkeypatch.setattr(torch.accelerator, "device_count", lambda: state[0])
    monkeypatch.setattr(
        torch.accelerator,
        "current_accelerator",
        lambda *_, **__: torch.device("cuda") if state[0] > 0 else None,
    )
    monkeypatch.setattr(
        torch.accelerator, "set_device_index", lambda d: state.append(torch.device(d).index)
    )
    return state


def test_the_config_offers_the_device_kinds_the_device_module_knows() -> None:
    assert DEVICES == dev.DEVICE_KINDS


def test_a_cpu_host_trains_on_the_cpu_and_refuses_cuda_naming_the_fix() -> None:
    assert dev.accelerator() is None and dev.accelerator_count() == 0
    assert dev.resolve("auto") == "cpu" and dev.resolve("cpu") == "cpu"
    assert dev.default_workers("auto") is None
    with pytest.raises(ValueError, match=r"device='cuda' but no GPU is visible.*--device cpu"):
        dev.resolve("cuda")
    with pytest.raises(ValueError, match="'tpu' is not one of"):
        dev.resolve("tpu")
    dev.check_workers(64, "auto")  # CPU workers: any count (they share the cores)
    assert dev.worker_device("auto", 3) == torch.device("cpu")


def test_a_gpu_host_gives_each_worker_its_own_gpu(gpus: list[int]) -> None:
    assert dev.resolve("auto") == "cuda" and dev.resolve("cuda") == "cuda"
    assert dev.resolve("cpu") == "cpu"  # asked for: the GPUs stay unused
    assert dev.default_workers("auto") == 2
    assert dev.default_workers("cpu") is None
    dev.check_workers(2, "auto")
    dev.check_workers(5, "cpu")
    with pytest.raises(ValueError) as err:
        dev.check_workers(3, "cuda")
    text = str(err.value)
    assert "3 workers" in text and "2 GPUs" in text
    assert "--nproc 2" in text and "--device cpu" in text
    # under torchrun only this host's workers need its GPUs
    dev.check_workers(8, "auto", local=2)
    assert dev.worker_device("auto", 1) == torch.device("cuda", 1)
    assert gpus[1:] == [1]  # made current
    with pytest.raises(ValueError, match="local rank 2 has no GPU of its own"):
        dev.worker_device("cuda", 2)


def test_one_gpu_host(gpus: list[int]) -> None:
    gpus[0] = 1
    assert dev.default_workers("auto") == 1
    with pytest.raises(ValueError, match="1 GPU visible"):
        dev.check_workers(2, "auto")


def test_backends_and_ddp_device_ids() -> None:
    assert dev.backend_for("cuda:1") == "nccl" and dev.backend_for("cpu") == "gloo"
    assert dev.device_ids(torch.device("cuda", 3)) == [3]
    assert dev.device_ids(torch.device("cpu")) is None
    assert dev.current() == torch.device("cpu")  # no process group here


def test_random_state_round_trips_and_reads_old_checkpoints() -> None:
    cpu = torch.device("cpu")
    torch.manual_seed(7)
    state = dev.rng_state(cpu)
    assert set(state) == {"cpu"}
    first = torch.rand(3)
    dev.set_rng_state(state, cpu)
    torch.testing.assert_close(torch.rand(3), first, rtol=0, atol=0)
    dev.set_rng_state(state["cpu"], cpu)  # a bare tensor: what checkpoints held before
    torch.testing.assert_close(torch.rand(3), first, rtol=0, atol=0)
    before = torch.get_rng_state()
    with dev.fork_rng(cpu):
        torch.rand(5)
    assert torch.equal(torch.get_rng_state(), before)


def test_autocast_runs_the_training_dtype_with_fp32_weights() -> None:
    cpu = torch.device("cpu")
    linear = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4)
    assert dev.autocast_context("fp32", cpu) is contextlib.nullcontext
    with dev.autocast_context("bf16", cpu)():
        out = linear(x)
    assert out.dtype == torch.bfloat16 and linear.weight.dtype == torch.float32
    reference = torch.nn.functional.linear(x.bfloat16(), linear.weight.bfloat16(),
                                           linear.bias.bfloat16())  # fmt: skip
    torch.testing.assert_close(out, reference)


def test_memory_and_names_on_the_cpu() -> None:
    cpu = torch.device("cpu")
    assert dev.total_memory_bytes(cpu) is None
    assert dev.peak_memory_bytes(cpu) > 0  # the process's peak resident size
    assert dev.device_name(cpu) == "cpu"
    assert dev.profiler_activities(cpu) == [torch.profiler.ProfilerActivity.CPU]
    now = dev.timer(cpu)
    assert now() <= now()


def test_python_dash_m_plait_is_the_plait_command() -> None:
    out = subprocess.run([sys.executable, "-m", "plait", "--version"], capture_output=True,
                         text=True, check=True)  # fmt: skip
    assert out.stdout.startswith("plait ")
