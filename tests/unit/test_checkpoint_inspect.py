"""`plait checkpoint`: describe() of a real one-process checkpoint (step, parameters,
verified; a flipped byte reported; metadata pickles limited to DCP's classes), the model
exported to .pt and .safetensors loading into a fresh GPT bit for bit, and the CLI."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import pickle
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

from plait.checkpoint.inspect import describe, export_model
from plait.checkpoint.store import CheckpointStore
from plait.cli.main import main
from plait.models import GPT, GPTConfig

CFG = GPTConfig(vocab_size=11, seq_len=4, num_layers=2, hidden=8, num_heads=2)
STEP = 400
PLAN = {"dp": 1, "tp": 1, "pp": 1}


def _trained() -> tuple[GPT, dict[str, Any]]:
    """A tiny GPT after one AdamW step, and its optimizer state flattened as plait saves it."""
    torch.manual_seed(0)
    model = GPT(CFG)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(0, CFG.vocab_size, (2, CFG.seq_len + 1))
    GPT.loss(model(ids[:, :-1]), ids[:, 1:]).backward()
    opt.step()
    options = StateDictOptions(flatten_optimizer_state_dict=True)
    return model, get_optimizer_state_dict(model, opt, options=options)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    """A checkpoint saved by plait's CheckpointStore in a one-rank gloo group (destroyed
    before the tests: inspecting and exporting need no process group), and the model state."""
    tmp = tmp_path_factory.mktemp("ckpt")
    dist.init_process_group(
        "gloo",
        store=dist.FileStore(str(tmp / "store"), 1),  # type: ignore[attr-defined]
        rank=0,
        world_size=1,
    )
    try:
        model, optim = _trained()
        weights = {name: t.detach().clone() for name, t in model.state_dict().items()}
        state = {"model": dict(weights), "optim": optim, "rng": {"rank0": torch.get_rng_state()}}
        store = CheckpointStore(tmp / "run")
        record = {"family": "gpt", "config": dataclasses.asdict(CFG)}  # what training saves
        info = {"world_size": 1, "plan": PLAN, "config": {"seed": 3}, "model": record}
        store.save(STEP, state, info)
        store.wait()
    finally:
        dist.destroy_process_group()
    return tmp / "run" / f"step-{STEP:08d}", weights


@pytest.fixture
def damaged(saved: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path) -> Path:
    """A copy of the checkpoint with one byte of its shard flipped."""
    copy = Path(shutil.copytree(saved[0], tmp_path / saved[0].name))
    shard = copy / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    return copy


def _fresh_gpt_loads(state: dict[str, torch.Tensor], weights: dict[str, torch.Tensor]) -> None:
    torch.manual_seed(1)  # other initial weights than the saved ones
    fresh = GPT(CFG)
    fresh.load_state_dict(state, strict=True)
    loaded = fresh.state_dict()
    assert set(loaded) == set(weights)
    for name, tensor in weights.items():
        assert torch.equal(loaded[name], tensor), name


def test_dcp_flattens_the_state_under_its_top_level_keys(
    saved: tuple[Path, dict[str, torch.Tensor]],
) -> None:
    keys = set(FileSystemReader(saved[0]).read_metadata().state_dict_metadata)
    assert "model.layers.1.attn.q.weight" in keys and "rng.rank0" in keys
    assert "optim.state.layers.1.attn.q.weight.exp_avg" in keys
    assert "optim.param_groups.layers.1.attn.q.weight.lr" in keys


def test_describe_reports_step_parameters_and_verified(
    saved: tuple[Path, dict[str, torch.Tensor]],
) -> None:
    path, weights = saved
    d = describe(path)
    assert json.loads(json.dumps(d)) == d  # JSON-able as it is
    assert d["step"] == STEP and d["world_size"] == 1 and d["plan"] == PLAN
    assert d["verified"] is True and d["problem"] is None
    assert d["model"]["tensors"] == len(weights)
    assert d["model"]["parameters"] == GPT(CFG).num_params()
    assert d["model"]["bytes"] == 4 * GPT(CFG).num_params()  # fp32
    # AdamW: step, exp_avg, exp_avg_sq per parameter; lr, betas, ... are non-tensor values
    assert d["optim"]["tensors"] == 3 * len(weights) and d["optim"]["values"] > 0
    assert d["rng_states"] == 1
    assert {".metadata", "__0_0.distcp", "plait.json", "manifest.json"} <= set(d["files"])
    assert d["disk_bytes"] == sum(p.stat().st_size for p in path.iterdir())


def test_a_flipped_byte_is_reported_and_not_exported(damaged: Path, tmp_path: Path) -> None:
    d = describe(damaged)
    assert d["verified"] is False
    assert "__0_0.distcp" in d["problem"] and "checksum" in d["problem"]
    assert d["model"]["tensors"] > 0  # the metadata is whole: still described
    with pytest.raises(ValueError, match=r"cannot be exported: __0_0\.distcp"):
        export_model(damaged, tmp_path / "model.pt")
    assert not (tmp_path / "model.pt").exists()


def test_metadata_pickles_may_not_run_code(
    saved: tuple[Path, dict[str, torch.Tensor]],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    class Evil:
        def __reduce__(self) -> tuple[object, tuple[str]]:
            return (print, ("code from the checkpoint ran",))

    copy = Path(shutil.copytree(saved[0], tmp_path / saved[0].name))
    (copy / ".metadata").write_bytes(pickle.dumps(Evil()))
    d = describe(copy)  # verify already says why: described without the metadata
    assert d["verified"] is False and d["model"] is None
    # the manifest updated to match: now verified, and describe must refuse the pickle
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["files"][".metadata"]["size"] = (copy / ".metadata").stat().st_size
    digest = hashlib.sha256((copy / ".metadata").read_bytes()).hexdigest()
    manifest["files"][".metadata"]["sha256"] = digest
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match=r"refers to builtins\.print"):
        describe(copy)
    assert "ran" not in capsys.readouterr().out


def test_export_pt_loads_into_a_fresh_gpt(
    saved: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path
) -> None:
    path, weights = saved
    out = export_model(path, tmp_path / "sub" / "model.pt")
    assert out == tmp_path / "sub" / "model.pt" and not list(out.parent.glob("*.partial"))
    _fresh_gpt_loads(torch.load(out, weights_only=True), weights)


def test_export_safetensors_loads_into_a_fresh_gpt(
    saved: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path
) -> None:
    safetensors_torch = pytest.importorskip("safetensors.torch")
    path, weights = saved
    out = export_model(path, tmp_path / "model.safetensors")
    _fresh_gpt_loads(safetensors_torch.load_file(str(out)), weights)


def test_not_a_checkpoint_raises_naming_what_is_missing(
    saved: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path
) -> None:
    with pytest.raises(ValueError, match=r"does not exist"):
        describe(tmp_path / "nowhere")
    with pytest.raises(ValueError, match=r"no plait\.json or \.metadata"):
        describe(tmp_path)
    # the run's folder rather than one checkpoint: the error names the one to give
    with pytest.raises(ValueError, match=f"give one of them, e.g. .*{saved[0].name}"):
        export_model(saved[0].parent, tmp_path / "model.pt")


def test_cli_inspect(
    saved: tuple[Path, dict[str, torch.Tensor]], damaged: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["checkpoint", "inspect", str(saved[0]), "--json"]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and json.loads(out)["step"] == STEP
    assert main(["checkpoint", "inspect", str(saved[0])]) == 0
    text = capsys.readouterr().out
    assert f"step        {STEP}" in text and "verified    OK" in text
    assert main(["checkpoint", "inspect", str(damaged)]) == 1  # damaged: scripts can tell
    assert "FAILED: __0_0.distcp" in capsys.readouterr().out


def test_cli_export_and_bad_input(
    saved: tuple[Path, dict[str, torch.Tensor]],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    out = tmp_path / "model.pt"
    assert main(["checkpoint", "export", str(saved[0]), "--out", str(out)]) == 0
    assert out.is_file() and str(out) in capsys.readouterr().out
    folder = tmp_path / "not-a-checkpoint"
    folder.mkdir()
    assert main(["checkpoint", "inspect", str(folder)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(folder) in err and "plait.json" in err


def test_safetensors_missing_says_how_to_fix(
    saved: tuple[Path, dict[str, torch.Tensor]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)  # import now fails
    with pytest.raises(ValueError, match=r"pip install safetensors`, or give a \.pt name"):
        export_model(saved[0], tmp_path / "model.safetensors")


def test_an_export_carries_its_config_and_loads_without_guessing(
    saved: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path
) -> None:
    pytest.importorskip("safetensors")
    from plait.models.record import load_exported

    path, weights = saved
    out = export_model(path, tmp_path / "model.safetensors")
    sidecar = json.loads((tmp_path / "model.json").read_text())
    assert sidecar["model"] == {"family": "gpt", "config": dataclasses.asdict(CFG)}
    model = load_exported(out)
    assert isinstance(model, GPT) and model.cfg == CFG
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(tensor, weights[name], rtol=0, atol=0)
    with pytest.raises(ValueError, match="was not written by `plait checkpoint export`"):
        load_exported(tmp_path / "elsewhere.safetensors")


def test_cli_export_hf_of_plaits_gpt_loads_in_transformers(
    saved: tuple[Path, dict[str, torch.Tensor]], tmp_path: Path
) -> None:
    transformers = pytest.importorskip("transformers")
    path, weights = saved
    out = tmp_path / "hf"
    assert main(["checkpoint", "export", str(path), "--format", "hf", "--out", str(out)]) == 0
    gpt = GPT(CFG)
    gpt.load_state_dict(weights)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.randint(0, CFG.vocab_size, (3, CFG.seq_len), generator=torch.Generator())
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, gpt.eval()(ids), rtol=1e-4, atol=1e-4)
    (tmp_path / "file").write_text("")
    assert main(["checkpoint", "export", str(path), "--format", "hf", "--out",
                 str(tmp_path / "file")]) == 2  # fmt: skip
