"""A Hugging Face model in and out of plait, end to end: a random Llama folder saved by
transformers trains 2 steps from `--init-from` on a 2-stage pipeline (2 gloo workers), its
checkpoint exports with `--format hf`, and `from_pretrained` of that folder gives the logits
of plait's model rebuilt from the checkpoint's plain export (1e-4, fp32)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from plait.cli.main import main  # noqa: E402
from plait.models import hf as hf_models  # noqa: E402
from plait.models.record import load_exported  # noqa: E402

pytestmark = pytest.mark.dist

VOCAB, SEQ = 128, 32


def test_llama_trains_from_a_folder_and_exports_one_transformers_loads(tmp_path: Path) -> None:
    torch.manual_seed(3)
    config = hf_models.tiny_llama_config(vocab_size=VOCAB, seq_len=SEQ, num_layers=2)
    original = transformers.LlamaForCausalLM(config).eval()
    folder = tmp_path / "llama"
    original.save_pretrained(folder)
    run_dir = tmp_path / "run"
    assert main(["train", "--init-from", str(folder), "--pp", "2", "--max-steps", "2",
                 "--seq-len", str(SEQ), "--batch-size", "8", "--checkpoint-every", "2",
                 "--sample-chars", "0", "--run-dir", str(run_dir)]) == 0  # fmt: skip
    resolved = json.loads((run_dir / "config.json").read_text())
    assert resolved["model"]["name"] == "hf-llama" and resolved["init_from"] == str(folder)
    checkpoint = run_dir / "checkpoints" / "step-00000002"
    exported = tmp_path / "hf"
    assert main(["checkpoint", "export", str(checkpoint), "--format", "hf",
                 "--out", str(exported)]) == 0  # fmt: skip
    plain = tmp_path / "model.safetensors"
    assert main(["checkpoint", "export", str(checkpoint), "--out", str(plain)]) == 0

    mine = load_exported(plain).eval()  # plait's model, rebuilt from the export's record
    loaded = transformers.AutoModelForCausalLM.from_pretrained(exported).eval()
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = mine(ids)
        torch.testing.assert_close(loaded(ids).logits, logits, rtol=1e-4, atol=1e-4)
        trained = (logits - original(ids).logits).abs().max()
    assert trained > 1e-3  # two AdamW steps at lr 3e-3 moved the weights
