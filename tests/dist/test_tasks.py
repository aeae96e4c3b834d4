"""Any model on any data from the command line and from Python: ResNet-18 on the digits
that ship with scikit-learn, CIFAR-100 from a folder, Hugging Face models on synthetic
tokens, and a user's own module through `plait.train.run`, each against one process."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from plait.cli.main import main
from plait.config import load_config

pytestmark = pytest.mark.dist

TOL = {"rtol": 1e-5, "atol": 1e-5}
STEPS, BATCH, LR = 3, 16, 3e-3


def _losses(run_dir: Path) -> list[float]:
    rows = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(r)["loss"] for r in rows]


def _toml(path: Path, top: dict[str, object], **sections: dict[str, object]) -> Path:
    def value(v: object) -> str:
        return json.dumps(v) if isinstance(v, str) else str(v).lower()

    lines = [f"{k} = {value(v)}" for k, v in top.items()]
    for name, fields in sections.items():
        lines += [f"[{name}]", *(f"{k} = {value(v)}" for k, v in fields.items())]
    path.write_text("\n".join(lines) + "\n")
    return path


def _digits_reference(seed: int) -> tuple[torch.Tensor, ...]:
    """scikit-learn's digits as the task promises them: [n, 1, 8, 8] in [-0.5, 0.5], a
    fixed shuffle (seed 0), the last 20% for validation."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    x = torch.tensor(bunch.images, dtype=torch.float32)[:, None] / 16.0 - 0.5
    y = torch.tensor(bunch.target)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    x, y = x[order], y[order]
    cut = len(y) - int(len(y) * 0.2)
    return x[:cut], y[:cut], x[cut:], y[cut:]


def _train_reference(model: nn.Module, draw, steps: int) -> list[float]:  # type: ignore[no-untyped-def]
    """Plain AdamW with global-norm clipping at 1 (the run's defaults), one process."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    losses = []
    for step in range(steps):
        x, y = draw(step)
        opt.zero_grad()
        loss = F.cross_entropy(model(x).flatten(0, -2), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("layout", [{"dp": 2, "pp": 1, "microbatches": 1},
                                    {"dp": 1, "pp": 2, "microbatches": 2}])  # fmt: skip
def test_resnet18_on_digits_matches_one_process(tmp_path: Path, layout: dict[str, int]) -> None:
    pytest.importorskip("sklearn")
    from plait.models import ResNet18

    seed = 3
    config = _toml(tmp_path / "digits.toml",
                   {"data": "digits", "max_steps": STEPS, "batch_size": BATCH, "seed": seed},
                   model={"name": "resnet18", "width": 4}, parallel=layout)  # fmt: skip
    run_dir = tmp_path / "run"
    assert main(["train", "--config", str(config), "--run-dir", str(run_dir)]) == 0

    x_train, y_train, x_val, y_val = _digits_reference(seed)

    def draw(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(seed * 1_000_003 + step)
        picked = torch.randint(0, len(y_train), (BATCH,), generator=g)
        return x_train[picked], y_train[picked]

    torch.manual_seed(seed)
    ref = ResNet18(num_classes=10, width=4, norm="group", in_channels=1)
    expected = _train_reference(ref, draw, STEPS)
    torch.testing.assert_close(torch.tensor(_losses(run_dir)), torch.tensor(expected), **TOL)
    with torch.no_grad():
        correct = (ref.eval()(x_val).argmax(dim=1) == y_val).sum().item()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["validation"]["samples"] == len(y_val)
    assert summary["validation"]["accuracy"] == pytest.approx(correct / len(y_val), abs=1e-9)


def test_hf_models_train_on_synthetic_tokens_like_one_process(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    from plait.data import SyntheticTokens

    for name in ("hf-gpt2", "hf-llama"):
        config = _toml(tmp_path / f"{name}.toml",
                       {"data": "synthetic", "max_steps": 2, "batch_size": 8},
                       model={"name": name, "layers": 2, "hidden": 32, "heads": 4, "seq_len": 16},
                       parallel={"pp": 2, "microbatches": 2})  # fmt: skip
        run_dir = tmp_path / name
        assert main(["train", "--config", str(config), "--run-dir", str(run_dir)]) == 0
        data = SyntheticTokens(vocab=64, seq_len=16, size=4096, seed=0)
        torch.manual_seed(0)
        common = {"vocab_size": 64, "tie_word_embeddings": False, "bos_token_id": 63,
                  "eos_token_id": 63, "attn_implementation": "sdpa"}  # fmt: skip
        if name == "hf-gpt2":
            hf_config = transformers.GPT2Config(n_positions=16, n_embd=32, n_layer=2, n_head=4,
                                                resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                                **common)  # fmt: skip
            ref = transformers.GPT2LMHeadModel(hf_config)
        else:
            hf_config = transformers.LlamaConfig(max_position_embeddings=16, hidden_size=32,
                                                 intermediate_size=64, num_hidden_layers=2,
                                                 num_attention_heads=4, num_key_value_heads=2,
                                                 **common)  # fmt: skip
            ref = transformers.LlamaForCausalLM(hf_config)

        expected = _train_reference(_Logits(ref), lambda step, d=data: d.batch(step, 8), 2)
        torch.testing.assert_close(torch.tensor(_losses(run_dir)), torch.tensor(expected), **TOL)


class _Logits(nn.Module):
    """A Hugging Face causal LM as plain ids -> logits."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids).logits


def _write_cifar(root: Path, sizes: dict[str, int]) -> dict[str, tuple[np.ndarray, list[int]]]:
    """A tiny copy of the CIFAR-100 python release's layout: pickled dicts of bytes keys."""
    folder = root / "cifar-100-python"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    written = {}
    for split, n in sizes.items():
        data = rng.integers(0, 256, (n, 3072), dtype=np.uint8)
        fine = [int(v) for v in rng.integers(0, 100, n)]
        content = {b"data": data, b"fine_labels": fine, b"coarse_labels": [f // 5 for f in fine]}
        (folder / split).write_bytes(pickle.dumps(content, protocol=2))
        written[split] = (data, fine)
    (folder / "meta").write_bytes(pickle.dumps({b"fine_label_names": [b"x"] * 100}, protocol=2))
    return written


def test_cifar100_from_a_folder_feeds_resnet18(tmp_path: Path) -> None:
    from plait.data.cifar import CIFAR100_MEAN, CIFAR100_STD
    from plait.train.task import task_from_config

    written = _write_cifar(tmp_path / "c", {"train": 12, "test": 5})
    cfg = load_config(**{"data": f"cifar100:{tmp_path / 'c'}", "model.name": "resnet18",
                         "model.width": 4, "batch_size": 4, "parallel.pp": 1})  # fmt: skip
    task = task_from_config(cfg)
    images, labels = task.batch(2)
    g = torch.Generator().manual_seed(2)  # seed 0: (0 * 1_000_003 + step)
    picked = torch.randint(0, 12, (4,), generator=g)
    raw, fine = written["train"]
    expected = torch.tensor(raw[picked.numpy()], dtype=torch.float32).view(4, 3, 32, 32) / 255
    mean, std = torch.tensor(CIFAR100_MEAN), torch.tensor(CIFAR100_STD)
    expected = (expected - mean.view(1, 3, 1, 1)) / std.view(1, 3, 1, 1)
    torch.testing.assert_close(images, expected)
    assert labels.tolist() == [fine[i] for i in picked.tolist()]
    assert task.validation is not None
    val_labels = torch.cat([y for _, y in task.validation()])
    assert val_labels.tolist() == written["test"][1]
    assert task.model()(images).shape == (4, 100)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"model.name": "resnet18"}, "model 'resnet18' cannot train on data='stdlib'"),
        ({"data": "digits"}, "model 'gpt' cannot train on data='digits'"),
        ({"data": "mnist"}, "data='mnist' is unknown"),
        ({"data": "cifar100", "model.name": "resnet18"}, "data='cifar100:PATH'"),
        ({"data": "cifar100:/nonexistent", "model.name": "resnet18"}, "is not a folder"),
        ({"model.name": "bert"}, "model name='bert' is unknown"),
        ({"model.name": "resnet18", "data": "digits", "parallel.tp": 2}, "tensor-parallel plan"),
        ({"model.name": "resnet18", "data": "digits", "parallel.pp": 11}, "exceed the model's 10"),
    ],
)
def test_mismatched_model_and_data_are_refused(overrides: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        load_config(**overrides)


def test_cli_refuses_a_mismatch_before_any_worker_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = _toml(tmp_path / "bad.toml", {"data": "stdlib"}, model={"name": "resnet18"})
    assert main(["train", "--config", str(config), "--run-dir", str(tmp_path / "r")]) == 2
    assert "model 'resnet18' cannot train on data='stdlib'" in capsys.readouterr().err


def _mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                         nn.Linear(16, 3))  # fmt: skip


def test_run_trains_ones_own_model_and_dataset(tmp_path: Path) -> None:
    from plait.train import run
    from plait.train.task import accuracy

    g = torch.Generator().manual_seed(1)
    inputs = torch.randn(64, 6, generator=g)
    targets = (inputs[:, 0] > 0).long() + (inputs[:, 1] > 0).long()
    val = (inputs[:16], targets[:16])
    torch.manual_seed(5)
    model = _mlp()
    ref = _mlp()
    ref.load_state_dict(model.state_dict())
    summary = run(model, (inputs, targets),
                  {"parallel.pp": 2, "parallel.microbatches": 2, "max_steps": STEPS,
                   "batch_size": 8, "run_dir": str(tmp_path / "own"), "seed": 7},
                  metrics={"accuracy": accuracy}, validation=val)  # fmt: skip

    def draw(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        picked = torch.randint(
            0, 64, (8,), generator=torch.Generator().manual_seed(7 * 1_000_003 + step)
        )
        return inputs[picked], targets[picked]

    expected = _train_reference(ref, draw, STEPS)
    torch.testing.assert_close(
        torch.tensor(_losses(tmp_path / "own")), torch.tensor(expected), **TOL
    )
    with torch.no_grad():
        correct = (ref(val[0]).argmax(dim=1) == val[1]).sum().item()
    assert summary["validation"]["accuracy"] == pytest.approx(correct / 16, abs=1e-9)
