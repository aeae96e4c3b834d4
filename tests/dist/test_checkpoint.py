"""Checkpoints: saved under one layout and loaded under another (another world size too),
the next step equals one process's; resuming on the same layout is bit-identical (fp32,
bf16, an asynchronous schedule); damaged checkpoints are skipped for the one before."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from plait.blocks import as_blocks
from plait.checkpoint import CheckpointStore, find, published
from plait.config import ParallelPlan
from plait.models import GPT, GPTConfig
from plait.train.checkpointing import resume, save
from plait.train.engine import Engine
from plait.train.parallelize import parallelize
from plait.train.optim import param_groups

from .harness import run_world

pytestmark = pytest.mark.dist

TOL = {"rtol": 1e-5, "atol": 1e-5}
VOCAB, SEQ, BATCH = 23, 8, 8


def _model() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=VOCAB, seq_len=SEQ, num_layers=6, hidden=16, num_heads=2))


def _optimizer(params: object) -> torch.optim.Optimizer:
    # eps above rounding noise: attention's key bias has a gradient that is zero up to
    # rounding, which Adam's normalisation would otherwise turn into layout-dependent steps
    return torch.optim.AdamW(params, lr=1e-2, eps=1e-4)  # type: ignore[arg-type]


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(50 + step)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def _sgd(params: object) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)  # type: ignore[arg-type]


def _engine(optimizer: object = _optimizer, **plan: object) -> Engine:
    return parallelize(_model(), ParallelPlan(**plan), optimizer, GPT.loss, device="cpu")  # type: ignore[arg-type]


def _reference(steps: int, optimizer: object = _optimizer) -> list[torch.nn.Module]:
    """One process, the whole batch, `steps` optimizer steps: the blocks' weights."""
    model = _model()
    opt = optimizer(model.parameters())  # type: ignore[operator]
    for step in range(steps):
        opt.zero_grad()
        GPT.loss(model(_batch(step)[0]), _batch(step)[1]).backward()
        opt.step()
    return as_blocks(model)


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _weights(engine: Engine) -> dict[int, list[torch.Tensor]]:
    """Every block's whole parameters on this rank (a collective under tp or ZeRO-3)."""
    out = {}
    for stage in engine.stages.values():
        for j, block in enumerate(stage.blocks):
            out[stage.first_block + j] = [_full(p).detach().clone() for p in block.parameters()]
    return out


def _train(engine: Engine, start: int, stop: int) -> None:
    for step in range(start, stop):
        engine.step(_batch(step))


def _save(engine: Engine, root: Path, step: int) -> None:
    store = CheckpointStore(root)
    save(engine, store, step, {"plan": {}})
    store.wait()


def _load_and_step(root: Path, where: str, optimizer: object = _optimizer, **plan: object) -> None:
    """Resume the checkpoint in `root` (step 2) under `plan`, run step 3: one process's."""
    engine = _engine(optimizer, **plan)
    found = resume(engine, CheckpointStore(root), "auto")
    assert found is not None and found.step == 2
    _train(engine, 2, 3)
    reference = _reference(3, optimizer)
    for index, weights in _weights(engine).items():
        for p, q in zip(weights, reference[index].parameters(), strict=True):
            torch.testing.assert_close(p, q.detach(), **TOL, msg=f"{where} block {index}")


def _grouped(params: object) -> torch.optim.Optimizer:
    # plait's weight-decay groups, with the embeddings and the head (the matrices of VOCAB
    # or SEQ rows) in a third group without decay: its 3 tensors leave some rank's ZeRO-1
    # share of it empty on 4 ranks, which torch's flattened state dict cannot load alone
    decayed, plain = param_groups(params, 0.1)  # type: ignore[arg-type]
    tables = [p for p in decayed["params"] if p.shape[0] in (VOCAB, SEQ)]  # type: ignore[attr-defined]
    matrices = [p for p in decayed["params"] if p.shape[0] not in (VOCAB, SEQ)]  # type: ignore[attr-defined]
    groups = [{**decayed, "params": matrices}, plain, {"params": tables, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=1e-2, eps=1e-4)


def _empty_group_somewhere(engine: Engine) -> bool:
    """Whether any rank's ZeRO-1 share of a parameter group is empty (a collective)."""
    local = [getattr(o, "optim", o) for o in engine.optimizers.values()]
    empty = any(not g["params"] for o in local for g in o.param_groups)
    flag = torch.tensor(float(empty))
    dist.all_reduce(flag)
    return bool(flag.item())


def _two_workers(rank: int, world: int, tmp: str) -> None:
    torch.use_deterministic_algorithms(True)
    root = Path(tmp)
    engine = _engine(pp=2, microbatches=2)
    _train(engine, 0, 2)
    _save(engine, root / "pp2", 2)
    engine = _engine(pp=1, tp=2)
    _train(engine, 0, 2)
    _save(engine, root / "tp2", 2)
    _load_and_step(root / "pp2", "pp=2 -> tp=2", pp=1, tp=2)
    dist.barrier()


def _four_workers(rank: int, world: int, tmp: str) -> None:
    torch.use_deterministic_algorithms(True)
    root = Path(tmp)
    _load_and_step(root / "pp2", "pp=2 -> dp=2 x pp=2 interleaved", dp=2, pp=2,
                   schedule="interleaved", chunks=2, microbatches=2)  # fmt: skip
    _load_and_step(root / "tp2", "tp=2 -> dp=2 x pp=2 ZeRO-3", dp=2, pp=2, zero=3,
                   microbatches=2)  # fmt: skip
    engine = _engine(dp=4, pp=1, zero=3, microbatches=2)
    _train(engine, 0, 2)
    _save(engine, root / "zero3", 2)
    _load_and_step(root / "zero3", "dp=4 ZeRO-3 -> dp=2 x tp=2 ZeRO-2", dp=2, tp=2, pp=1,
                   zero=2, microbatches=1)  # fmt: skip
    engine = _engine(_grouped, dp=4, pp=1, zero=1, microbatches=1)
    assert _empty_group_somewhere(engine), "the case needs a rank with an empty group"
    _train(engine, 0, 2)
    _save(engine, root / "zero1-groups", 2)
    _load_and_step(root / "zero1-groups", "dp=4 ZeRO-1, an empty group -> the same", _grouped,
                   dp=4, pp=1, zero=1, microbatches=1)  # fmt: skip
    dist.barrier()


def _back_to_two(rank: int, world: int, tmp: str) -> None:
    torch.use_deterministic_algorithms(True)
    _load_and_step(Path(tmp) / "zero3", "dp=4 ZeRO-3 -> pp=2", pp=2, microbatches=2)
    dist.barrier()


def test_checkpoints_load_under_any_layout_and_world(tmp_path: Path) -> None:
    """2 workers save under pp=2 and tp=2; 4 workers load those under dp×pp interleaved
    and dp×pp ZeRO-3, and save under dp=4 ZeRO-3 and under dp=4 ZeRO-1 with weight-decay
    groups of which some rank holds an empty share (loaded again under that layout); 2
    workers load the ZeRO-3 one under pp=2. After loading, the next step's weights equal
    one process's."""
    run_world(tmp_path, 2, _two_workers, str(tmp_path))
    run_world(tmp_path, 4, _four_workers, str(tmp_path))
    run_world(tmp_path, 2, _back_to_two, str(tmp_path))


def _momentum(rank: int, world: int, tmp: str) -> None:
    torch.use_deterministic_algorithms(True)
    root = Path(tmp)
    engine = _engine(_sgd, dp=2, pp=1, zero=1, microbatches=1)
    _train(engine, 0, 2)
    _save(engine, root / "sgd-zero1", 2)
    _load_and_step(root / "sgd-zero1", "SGD momentum, dp=2 ZeRO-1 -> pp=2", _sgd, pp=2,
                   microbatches=2)  # fmt: skip
    engine = _engine(_sgd, pp=2, microbatches=2)
    _train(engine, 0, 2)
    _save(engine, root / "sgd-pp2", 2)
    _load_and_step(root / "sgd-pp2", "SGD momentum, pp=2 -> dp=2 ZeRO-1", _sgd, dp=2, pp=1,
                   zero=1, microbatches=1)  # fmt: skip
    dist.barrier()


def test_sgd_momentum_state_survives_a_layout_change(tmp_path: Path) -> None:
    """The momentum buffers, sharded by ZeRO-1 or split by stages, are saved and loaded
    under the other layout: the next step equals one process's SGD step."""
    run_world(tmp_path, 2, _momentum, str(tmp_path))


def _exact(rank: int, world: int, tmp: str) -> None:
    torch.use_deterministic_algorithms(True)
    for name, plan in {
        "fp32": {"pp": 2, "microbatches": 2},
        "bf16": {"pp": 2, "microbatches": 2, "dtype": "bf16"},
        "2bw": {"pp": 2, "microbatches": 2, "schedule": "2bw"},
        # error feedback's residuals are training state: dropping them changes the sends
        "threshold": {"dp": 2, "pp": 1, "microbatches": 2, "compress": "threshold:0.004"},
    }.items():
        root = Path(tmp) / name
        store = CheckpointStore(root)
        straight = _engine(**plan)
        for step in range(4):  # a checkpoint after step 2, as the resumed run had
            straight.step(_batch(step))
            if step + 1 == 2:
                save(straight, store, 2, {"plan": plan})
        store.wait()
        straight.drain()
        resumed = _engine(**plan)
        assert resume(resumed, CheckpointStore(root), "auto") is not None
        _train(resumed, 2, 4)
        resumed.drain()
        a, b = _weights(straight), _weights(resumed)
        for index in a:
            for p, q in zip(a[index], b[index], strict=True):
                assert torch.equal(p, q), f"{name}: block {index} differs after resuming"
    dist.barrier()


def test_resuming_on_the_same_layout_is_bit_identical(tmp_path: Path) -> None:
    run_world(tmp_path, 2, _exact, str(tmp_path))


def _damaged(rank: int, world: int, tmp: str) -> None:
    root = Path(tmp) / "damaged"
    engine = _engine(pp=2, microbatches=2)
    store = CheckpointStore(root)
    for step in (1, 2, 3):
        engine.step(_batch(step - 1))
        save(engine, store, step, {"plan": {}})
    store.wait()
    dist.barrier()
    if rank == 0:
        newest, middle = published(root)[:2]
        shard = sorted(newest.glob("*.distcp"))[0]
        shard.write_bytes(shard.read_bytes()[:-7])  # truncated
        data = bytearray(sorted(middle.glob("*.distcp"))[-1].read_bytes())
        data[len(data) // 2] ^= 0x40  # one flipped bit
        sorted(middle.glob("*.distcp"))[-1].write_bytes(bytes(data))
    dist.barrier()
    found = resume(_engine(pp=2, microbatches=2), CheckpointStore(root), "auto")
    assert found is not None and found.step == 1
    with pytest.raises(ValueError, match="does not match its checksum"):
        find(published(root)[1], root)
    dist.barrier()


def test_damaged_checkpoints_are_skipped_for_the_one_before(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    run_world(tmp_path, 2, _damaged, str(tmp_path))
    err = capfd.readouterr().err
    assert "skipping checkpoint step-00000003" in err and "truncated" in err
    assert "skipping checkpoint step-00000002" in err and "checksum" in err
    assert "resuming from step 1" in err


def test_keep_prunes_old_checkpoints(tmp_path: Path) -> None:
    run_world(tmp_path, 2, _keep_two, str(tmp_path))
    assert [p.name for p in published(tmp_path / "kept")] == ["step-00000004", "step-00000003"]


def _keep_two(rank: int, world: int, tmp: str) -> None:
    engine = _engine(pp=2, microbatches=2)
    store = CheckpointStore(Path(tmp) / "kept", keep=2)
    for step in range(1, 5):
        engine.step(_batch(step))
        save(engine, store, step, {"plan": {}})
    store.wait()
    dist.barrier()


def test_a_save_is_published_as_soon_as_it_is_written(tmp_path: Path) -> None:
    run_world(tmp_path, 2, _prompt, str(tmp_path))


def _prompt(rank: int, world: int, tmp: str) -> None:
    import time

    engine = _engine(pp=2, microbatches=2)
    root = Path(tmp) / "prompt"
    store = CheckpointStore(root)
    engine.step(_batch(0))
    save(engine, store, 1, {"plan": {}})
    if rank == 0:  # published by the writer: training makes no further call (was: at a poll)
        deadline = time.monotonic() + 60
        while not published(root) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [p.name for p in published(root)] == ["step-00000001"]
    dist.barrier()
    engine.step(_batch(1))
    save(engine, store, 2, {"plan": {}})
    store.settle()  # a step boundary: on rank 0 the save is published when it returns
    if rank == 0:
        assert [p.name for p in published(root)] == ["step-00000002", "step-00000001"]
        found = find("auto", root)
        assert found is not None and found.step == 2
    store.wait()
    dist.barrier()
