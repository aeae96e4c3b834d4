"""Hugging Face folders in and out, without workers: a random GPT-2 (tied embeddings) and a
Llama folder saved by transformers load through `--init-from` with transformers' own logits;
a model written back is loaded by `from_pretrained` with the same logits; plait's GPT exports
as a GPT-2; `read_pretrained` and the config refuse what they cannot take."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from plait.cli.main import main  # noqa: E402
from plait.config import load_config  # noqa: E402
from plait.models import GPT, GPTConfig  # noqa: E402
from plait.models import hf as hf_models  # noqa: E402
from plait.models.hf_io import (  # noqa: E402
    gpt2_config_for,
    gpt_as_gpt2_state,
    hf_state_dict,
    write_pretrained,
)
from plait.models.record import hf_config, model_from_record, model_record  # noqa: E402
from plait.pretrained import read_pretrained  # noqa: E402
from plait.train.task import task_from_config  # noqa: E402

VOCAB, SEQ = 128, 32
TOL = {"rtol": 1e-4, "atol": 1e-4}


def _folder(tmp: Path, family: str, *, tied: bool = False, shard: bool = False) -> Path:
    """A random model of `family` saved by transformers (no download)."""
    torch.manual_seed(1)
    if family == "gpt2":
        config = hf_models.tiny_gpt2_config(vocab_size=VOCAB, seq_len=SEQ)
        model = transformers.GPT2LMHeadModel
    else:
        config = hf_models.tiny_llama_config(vocab_size=VOCAB, seq_len=SEQ)
        model = transformers.LlamaForCausalLM
    config.tie_word_embeddings = tied
    path = tmp / f"{family}{'-tied' if tied else ''}{'-sharded' if shard else ''}"
    extra: dict[str, Any] = {"max_shard_size": "20KB"} if shard else {}
    model(config).save_pretrained(path, **extra)
    return path


def _reference_logits(path: Path, ids: torch.Tensor) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        return model.eval()(ids).logits


def _ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(7))


@pytest.mark.parametrize(
    ("family", "tied", "shard"),
    [("gpt2", True, False), ("gpt2", False, True), ("llama", False, False)],
    ids=["gpt2-tied", "gpt2-sharded", "llama"],
)
def test_init_from_gives_the_folders_logits(
    tmp_path: Path, family: str, tied: bool, shard: bool
) -> None:
    folder = _folder(tmp_path, family, tied=tied, shard=shard)
    if shard:
        assert (folder / "model.safetensors.index.json").is_file()
    cfg = load_config(init_from=str(folder), **{"model.seq_len": SEQ, "parallel.pp": 1})
    assert cfg.model.name == ("hf-gpt2" if family == "gpt2" else "hf-llama")
    assert (cfg.model.layers, cfg.model.hidden, cfg.model.heads) == (2, 32, 4)
    task = task_from_config(cfg)
    assert task.sample is None  # 128 ids cannot all be decoded as the corpus's 96 characters
    model = task.model().eval()
    ids = _ids()
    with torch.no_grad():
        torch.testing.assert_close(model(ids), _reference_logits(folder, ids), **TOL)
    if tied:  # untied for the pipeline: the head holds its own copy of the embedding
        head = model.blocks()[-1].lm_head.weight
        assert head is not model.blocks()[0].wte.weight
        torch.testing.assert_close(head, model.blocks()[0].wte.weight)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_a_trained_model_writes_a_folder_transformers_loads(tmp_path: Path, family: str) -> None:
    """Change the weights (as training would), write the folder, and compare the logits of
    `from_pretrained` with plait's model, and of plait's model rebuilt from its record."""
    folder = _folder(tmp_path, family, tied=family == "gpt2")
    cfg = load_config(init_from=str(folder), **{"model.seq_len": SEQ, "parallel.pp": 1})
    model = task_from_config(cfg).model().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    record = model_record(model)
    assert record is not None and json.loads(json.dumps(record)) == record
    out = write_pretrained(hf_state_dict(model.state_dict(), family), hf_config(record),
                           tmp_path / "out")  # fmt: skip
    assert {"config.json", "model.safetensors"} <= {p.name for p in out.iterdir()}
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False
    ids = _ids()
    with torch.no_grad():
        mine = model(ids)
        torch.testing.assert_close(_reference_logits(out, ids), mine, **TOL)
        rebuilt = model_from_record(record)
        rebuilt.load_state_dict(model.state_dict())
        torch.testing.assert_close(rebuilt.eval()(ids), mine, **TOL)


def test_plaits_gpt_exports_as_gpt2(tmp_path: Path) -> None:
    torch.manual_seed(0)
    gpt = GPT(GPTConfig(vocab_size=VOCAB, seq_len=SEQ, num_layers=2, hidden=32, num_heads=4))
    record = model_record(gpt)
    assert record is not None and record["family"] == "gpt"
    state = hf_state_dict(gpt_as_gpt2_state(gpt.state_dict()), "gpt2")
    out = write_pretrained(state, gpt2_config_for(record["config"]), tmp_path / "gpt2")
    ids = _ids()
    with torch.no_grad():
        torch.testing.assert_close(_reference_logits(out, ids), gpt.eval()(ids), **TOL)


def test_gpt_config_defaults_are_the_clis() -> None:
    cli, gpt = load_config().model, GPTConfig()
    mine = (gpt.num_layers, gpt.hidden, gpt.num_heads, gpt.seq_len, gpt.ffn_hidden, gpt.dropout)
    assert mine == (cli.layers, cli.hidden, cli.heads, cli.seq_len, cli.ffn_hidden, cli.dropout)


def test_folder_shape_and_refusals(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = _folder(tmp_path, "llama")
    shape = read_pretrained(str(folder))
    assert (shape.model, shape.kv_heads, shape.vocab_size, shape.max_positions) == (
        "hf-llama", 2, VOCAB, SEQ
    )  # fmt: skip
    with pytest.raises(ValueError, match="hidden=64 contradicts init_from"):
        load_config(init_from=str(folder), **{"model.hidden": 64, "model.seq_len": SEQ})
    with pytest.raises(ValueError, match="name='hf-gpt2' contradicts"):
        load_config(init_from=str(folder), **{"model.name": "hf-gpt2", "model.seq_len": SEQ})
    with pytest.raises(ValueError, match="seq_len=64 exceeds the 32 positions"):
        load_config(init_from=str(folder))
    with pytest.raises(ValueError, match=r"tp=4 must divide hf-llama's 2 key-value heads"):
        load_config(init_from=str(folder), **{"model.seq_len": SEQ, "parallel.tp": 4,
                                              "parallel.pp": 1})  # fmt: skip
    # a flag equal to plait's default still contradicts the folder: the CLI knows it was given
    assert main(["train", "--dry-run", "--init-from", str(folder), "--seq-len", str(SEQ),
                 "--pp", "2", "--hidden", "128"]) == 2  # fmt: skip
    assert "hidden=128 contradicts --init-from" in capsys.readouterr().err
    assert main(["train", "--dry-run", "--init-from", str(folder), "--seq-len", str(SEQ),
                 "--pp", "2", "--hidden", "32"]) == 0  # fmt: skip
    (folder / "model.safetensors").unlink()
    with pytest.raises(ValueError, match=r"no model\.safetensors"):
        read_pretrained(str(folder))
    with pytest.raises(ValueError, match="is not a folder"):
        read_pretrained(str(tmp_path / "nowhere"))
    bert = tmp_path / "bert"
    bert.mkdir()
    (bert / "config.json").write_text(json.dumps({"model_type": "bert"}))
    (bert / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="model_type='bert' is not supported"):
        read_pretrained(str(bert))
