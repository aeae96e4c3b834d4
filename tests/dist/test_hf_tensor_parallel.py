"""Tensor parallelism on Hugging Face Llama and GPT-2 layers: a tp=2 (and tp=2 × pp=2) run
computes the losses and gradients of one process; a GPT-2 checkpoint saved at tp=2 resumes
at tp=1; `plait train --model hf-gpt2 --tp 2` trains like one process; bad layouts are
refused before workers start."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from plait.blocks import as_blocks
from plait.checkpoint import CheckpointStore
from plait.cli.main import main
from plait.config import ParallelPlan, load_config
from plait.models.hf import HFBlocksModel
from plait.train.checkpointing import resume, save
from plait.train.engine import Engine
from plait.train.parallelize import parallelize

from .harness import run_world

pytestmark = pytest.mark.dist
pytest.importorskip("transformers")

TOL = {"rtol": 1e-5, "atol": 1e-5}


def _whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _model(family: str) -> nn.Module:
    from plait.models import hf

    torch.manual_seed(0)
    if family == "llama":
        return hf.llama_blocks_model(hf.tiny_llama_config(num_layers=2, hidden=32, num_heads=4,
                                                          num_kv_heads=2))  # fmt: skip
    return hf.gpt2_blocks_model(hf.tiny_gpt2_config(num_layers=2, hidden=32, num_heads=4))


def _sgd(params: object) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)  # type: ignore[arg-type]


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, 128, (4, 9), generator=torch.Generator().manual_seed(step))
    return ids[:, :-1], ids[:, 1:]


def _reference_step(ref: nn.Module, opt: torch.optim.Optimizer, step: int) -> torch.Tensor:
    """One process, the whole batch: the loss; gradients left in `ref`, then the update."""
    x, y = _batch(step)
    opt.zero_grad()
    loss = HFBlocksModel.loss(ref(x), y)
    loss.backward()
    return loss.detach()


def _check(engine: Engine, ref_blocks: list[nn.Module], what: str, where: str) -> None:
    """Every local block's whole `what` ("grad" or "weight") equals the reference's."""
    for stage in engine.stages.values():
        for j, block in enumerate(stage.blocks):
            theirs = dict(ref_blocks[stage.first_block + j].named_parameters())
            for name, p in block.named_parameters():
                mine, ref = (p.grad, theirs[name].grad) if what == "grad" else (p, theirs[name])
                assert mine is not None and ref is not None, name
                torch.testing.assert_close(_whole(mine).detach(), ref.detach(), **TOL,
                                           msg=f"{where}: {name} {what}")  # fmt: skip


def _hf_tp(rank: int, world: int, family: str, pp: int, tmp: str) -> None:
    model = _model(family)
    ref = copy.deepcopy(model)  # before sharding: the one-process model
    plan = ParallelPlan(dp=1, tp=world // pp, pp=pp, microbatches=2)
    engine = parallelize(model, plan, _sgd, HFBlocksModel.loss, device="cpu")
    ref_opt = _sgd(ref.parameters())
    ref_blocks = as_blocks(ref)
    for step in range(2):
        ref_loss = _reference_step(ref, ref_opt, step)
        report = engine.step(_batch(step))
        torch.testing.assert_close(torch.tensor(report.loss), ref_loss, **TOL)
        _check(engine, ref_blocks, "grad", f"tp={plan.tp} pp={pp} step {step}")
        ref_opt.step()
        _check(engine, ref_blocks, "weight", f"tp={plan.tp} pp={pp} step {step}")
    if family == "gpt2" and pp == 1:  # the same names and values at tp=1: resume there
        store = CheckpointStore(Path(tmp) / "tp2")
        save(engine, store, 2, {"plan": {}})
        store.wait()
        resumed = parallelize(_model(family), ParallelPlan(dp=1, tp=1, pp=2, microbatches=2),
                              _sgd, HFBlocksModel.loss, device="cpu")  # fmt: skip
        found = resume(resumed, store, "auto")
        assert found is not None and found.step == 2
        resumed.step(_batch(2))
        _reference_step(ref, ref_opt, 2)
        ref_opt.step()
        _check(resumed, ref_blocks, "weight", "tp=2 -> pp=2 tp=1, step 2")


# tp × pp once (Llama's): the pipeline adds nothing that depends on the family
@pytest.mark.parametrize(("family", "pp"), [("llama", 1), ("gpt2", 1), ("llama", 2)])
def test_hf_layers_under_tensor_parallelism_match_one_process(
    tmp_path: Path, family: str, pp: int
) -> None:
    run_world(tmp_path, 2 * pp, _hf_tp, family, pp, str(tmp_path))


def test_hf_gpt2_trains_under_tp_from_the_command_line_like_one_process(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    from plait.data import SyntheticTokens

    run_dir, steps = tmp_path / "run", 3
    assert main(["train", "--model", "hf-gpt2", "--tp", "2", "--pp", "1", "--data", "synthetic",
                 "--layers", "2", "--hidden", "64", "--heads", "4", "--seq-len", "32",
                 "--batch-size", "16", "--max-steps", str(steps), "--run-dir", str(run_dir),
                 "-q"]) == 0  # fmt: skip
    rows = [json.loads(r) for r in (run_dir / "metrics.jsonl").read_text().splitlines()]

    torch.manual_seed(0)  # the run's seed, its model's config and its optimizer's defaults
    ref = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=64, n_positions=32, n_embd=64, n_layer=2, n_head=4, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=63, eos_token_id=63,
        tie_word_embeddings=False, attn_implementation="sdpa"))  # fmt: skip
    params = list(ref.parameters())
    opt = torch.optim.AdamW([{"params": [p for p in params if p.ndim >= 2]},
                             {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}],
                            lr=3e-3, weight_decay=0.01)  # fmt: skip
    data = SyntheticTokens(vocab=64, seq_len=32, size=4096, seed=0)
    expected = []
    for step in range(steps):
        x, y = data.batch(step, 16)
        opt.zero_grad()
        loss = F.cross_entropy(ref(input_ids=x).logits.flatten(0, 1), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        expected.append(loss.item())
    assert [r["step"] for r in rows] == list(range(steps))
    torch.testing.assert_close(torch.tensor([r["loss"] for r in rows]), torch.tensor(expected),
                               **TOL)  # fmt: skip


def test_tensor_parallel_hf_configs_are_checked_before_workers_start() -> None:
    cfg = load_config(**{"model.name": "hf-gpt2", "data": "synthetic", "parallel.tp": 2})
    assert cfg.parallel.tp == 2
    with pytest.raises(ValueError, match="tp=4 must divide heads=6"):
        load_config(**{"model.name": "hf-gpt2", "data": "synthetic", "parallel.tp": 4,
                       "model.heads": 6, "model.hidden": 96, "parallel.pp": 1})  # fmt: skip
    with pytest.raises(ValueError, match="sequence_parallel with model 'hf-gpt2'"):
        load_config(**{"model.name": "hf-gpt2", "data": "synthetic", "parallel.tp": 2,
                       "parallel.sequence_parallel": True})  # fmt: skip
    with pytest.raises(ValueError, match="tp=4 must divide hf-llama's 2 key-value heads"):
        load_config(**{"model.name": "hf-llama", "data": "synthetic", "parallel.tp": 4,
                       "parallel.pp": 1})  # fmt: skip
