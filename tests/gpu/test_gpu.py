"""plait on one CUDA GPU against plain PyTorch on the same GPU.

Every test here is marked `gpu`: it runs where CUDA is and is skipped, saying why, on other
hosts (tests/conftest.py). The engine's tests run in one spawned NCCL worker on GPU 0, the
command-line ones through `plait` itself. Tolerances: fp32 with TF32 off equals the plain
loop to 1e-5 (losses and every gradient); bf16 and fp16 run the same kernels in the same
order as the plain autocast loop written here (one forward and backward per micro-batch,
gradients accumulated), so they agree to rtol 1e-3 / atol 1e-4, far inside what a wrong
cast, a missing unscale or a lost micro-batch would move.
"""

from __future__ import annotations

import copy
import datetime
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from plait.cli.main import main

pytestmark = pytest.mark.gpu

VOCAB, SEQ, BATCH, M = 37, 32, 8, 2
SMALL = ["--layers", "2", "--hidden", "64", "--heads", "4", "--seq-len", "32",
         "--batch-size", "8", "--sample-chars", "20", "--eval-batches", "0"]  # fmt: skip


def _entry(rank: int, store: str, fn: Callable[..., None], args: tuple[Any, ...]) -> None:
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", store=dist.FileStore(store, 1), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=120), device_id=device)  # fmt: skip
    try:
        fn(*args)
    finally:
        dist.destroy_process_group()


def _one_gpu(tmp_path: Path, fn: Callable[..., None], *args: Any) -> None:
    """Run `fn(*args)` in one spawned worker that has joined an NCCL group on GPU 0."""
    store = str(tmp_path / f"store-{fn.__name__}")
    mp.start_processes(_entry, args=(store, fn, args), nprocs=1, join=True, start_method="spawn")


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(11 + step)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return ids[:, :-1].cuda(), ids[:, 1:].cuda()


def _engine_against_plain_loop(dtype: str, tol: dict[str, float]) -> None:
    from plait.blocks import as_blocks
    from plait.config import ParallelPlan
    from plait.models import GPT, GPTConfig
    from plait.train.parallelize import parallelize

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=VOCAB, seq_len=SEQ, num_layers=2, hidden=64, num_heads=4))
    ref = copy.deepcopy(model).cuda()
    plan = ParallelPlan(pp=1, microbatches=M, schedule="1f1b", dtype=dtype)
    engine = parallelize(model, plan, lambda ps: torch.optim.AdamW(ps, lr=1e-3), GPT.loss,
                         device="cuda:0", grad_clip=1.0)  # fmt: skip
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0**16, growth_interval=200,
                                  enabled=dtype == "fp16")  # fmt: skip
    cast = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(dtype)
    blocks = as_blocks(ref)
    for step in range(3):
        x, y = _batch(step)
        opt.zero_grad(set_to_none=True)
        losses = []
        for xm, ym in zip(x.chunk(M), y.chunk(M), strict=True):
            with torch.autocast("cuda", dtype=cast or torch.float32, enabled=cast is not None):
                loss = GPT.loss(ref(xm), ym).float()
            scaler.scale(loss / M).backward()
            losses.append(loss.detach())
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        report = engine.step((x, y))
        where = f"{dtype} step {step}"
        torch.testing.assert_close(torch.tensor(report.loss).cuda(), torch.stack(losses).mean(),
                                   **tol, msg=where)  # fmt: skip
        stage = engine.stages[0]
        for j, block in enumerate(stage.blocks):
            theirs = list(blocks[stage.first_block + j].parameters())
            for p, q in zip(block.parameters(), theirs, strict=True):
                assert p.grad is not None and p.grad.is_cuda, where
                torch.testing.assert_close(p.grad, q.grad, **tol, msg=where)
        scaler.step(opt)
        scaler.update()
    assert all(p.is_cuda for p in engine.stages[0].parameters())


def test_fp32_engine_equals_a_plain_loop_with_tf32_off(tmp_path: Path) -> None:
    _one_gpu(tmp_path, _engine_against_plain_loop, "fp32", {"rtol": 1e-5, "atol": 1e-5})


def test_bf16_engine_equals_a_plain_autocast_loop(tmp_path: Path) -> None:
    _one_gpu(tmp_path, _engine_against_plain_loop, "bf16", {"rtol": 1e-3, "atol": 1e-4})


def test_fp16_engine_with_its_loss_scale_equals_a_plain_grad_scaler_loop(tmp_path: Path) -> None:
    _one_gpu(tmp_path, _engine_against_plain_loop, "fp16", {"rtol": 1e-3, "atol": 1e-4})


def test_profile_times_the_blocks_on_the_gpu_in_the_training_dtype(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code = main(["profile", "--device", "cuda", "--dtype", "bf16", "--layers", "2", "--json",
                 "--no-cache", "--codec", "none"])  # fmt: skip
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    device = out["device"]
    assert device["type"] == "cuda" and device["count"] == torch.cuda.device_count()
    assert device["name"] == torch.cuda.get_device_name(0)
    assert device["memory_bytes"] == torch.cuda.get_device_properties(0).total_memory
    assert device["flops_per_dtype"]["bf16"] > device["flops_per_dtype"]["fp32"] > 0
    assert all(b["forward_s"] > 0 and b["backward_s"] > 0 for b in out["blocks"])


def test_plan_auto_on_one_gpu_trains_one_worker(tmp_path: Path) -> None:
    run_dir = tmp_path / "auto"
    assert main(["train", "--plan", "auto", "--max-steps", "4", "--run-dir", str(run_dir),
                 *SMALL]) == 0  # fmt: skip
    summary = json.loads((run_dir / "summary.json").read_text())
    workers = torch.cuda.device_count()
    assert summary["plan"]["dp"] * summary["plan"]["tp"] * summary["plan"]["pp"] == workers
    assert summary["peak_memory_bytes"] > 0 and summary["sample"]


def _losses(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {int(r["step"]): float(r["loss"]) for r in rows}


def test_a_checkpoint_resumes_bit_identically_on_the_gpu(tmp_path: Path) -> None:
    from plait.bench.faults import final_weights

    common = ["--nproc", "1", "--pp", "1", "--microbatches", "2", "--dropout", "0.1",
              "--deterministic", "--checkpoint-every", "2", "--log-every", "1", *SMALL]  # fmt: skip
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    assert main(["train", "--max-steps", "4", "--run-dir", str(whole), *common]) == 0
    assert main(["train", "--max-steps", "2", "--run-dir", str(parts), *common]) == 0
    assert main(["train", "--max-steps", "4", "--run-dir", str(parts), "--resume", "auto",
                 *common]) == 0  # fmt: skip
    a, b = final_weights(whole), final_weights(parts)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert _losses(whole)[3] == _losses(parts)[3]  # dropout masks drawn from the GPU's RNG


def test_more_workers_than_gpus_is_one_line_before_any_worker_starts() -> None:
    count = torch.cuda.device_count()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run(
        [sys.executable, "-m", "plait", "train", "--nproc", str(count + 1), "--max-steps", "1"],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and f"{count + 1} workers on this host" in lines[0], out.stderr
    assert f"--nproc {count}" in lines[0] and "--device cpu" in lines[0]


def _event_times_against_the_profiler() -> None:
    from plait.config import ParallelPlan
    from plait.models import GPT, GPTConfig
    from plait.train.parallelize import parallelize

    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=VOCAB, seq_len=256, num_layers=4, hidden=512, num_heads=8)
    engine = parallelize(GPT(cfg), ParallelPlan(pp=1, microbatches=2), lambda ps:
                         torch.optim.AdamW(ps, lr=1e-3), GPT.loss, device="cuda:0")  # fmt: skip
    ids = torch.randint(0, VOCAB, (8, 257), device="cuda")
    batch = (ids[:, :-1], ids[:, 1:])
    engine.step(batch)  # warm-up: kernels chosen, memory cached
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        report = engine.step(batch)
        torch.cuda.synchronize()
    kernels: dict[str, float] = {}
    for e in prof.key_averages():
        if e.key.startswith("PP:"):
            kernels[e.key[3:]] = e.device_time_total / 1e6  # µs -> s
    for record in report.result.records:
        if record.label not in kernels or ("F" not in record.label and "B" not in record.label):
            continue
        measured, busy = record.end - record.start, kernels[record.label]
        # the action's events span its kernels: at least their time, and not far beyond
        assert measured >= 0.9 * busy, (record.label, measured, busy)
        assert measured <= 1.5 * busy + 2e-4, (record.label, measured, busy)


def test_action_event_times_span_the_kernels_the_profiler_labels(tmp_path: Path) -> None:
    _one_gpu(tmp_path, _event_times_against_the_profiler)
