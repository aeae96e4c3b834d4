"""Suite-wide settings: one intra-op thread per process (tiny tensors on a shared 2-core
machine only lose time to thread hand-offs), as every distributed worker also uses; and
GPUs hidden from every test not marked `gpu`, so that the suite runs the same on a GPU
host as on this CPU one (its workers would otherwise pick `cuda:LOCAL_RANK` and NCCL); and
a folder of its own per test for the decisions `--plan auto` keeps, so no test trains under
a plan another one decided."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

torch.set_num_threads(1)


def _cuda_ready() -> bool:
    return torch.cuda.is_available() and torch.cuda.device_count() > 0


@pytest.fixture(autouse=True)
def _gpus_for_gpu_tests_only(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> Iterator[None]:
    """A `gpu` test runs where CUDA is and is skipped, saying why, elsewhere. Every other
    test sees no GPU: in this process (torch's device queries answer "none") and in the
    worker processes it starts (CUDA_VISIBLE_DEVICES is empty in their environment)."""
    if request.node.get_closest_marker("gpu") is not None:
        if not _cuda_ready():
            pytest.skip("needs a CUDA GPU (torch with CUDA and a visible device)")
        yield
        return
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: False)
    monkeypatch.setattr(torch.accelerator, "device_count", lambda: 0)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda *_, **__: None)
    yield


@pytest.fixture(autouse=True)
def _decisions_of_its_own(
    monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory
) -> None:
    monkeypatch.setenv("PLAIT_PLANS_DIR", str(tmp_path_factory.mktemp("plans")))
