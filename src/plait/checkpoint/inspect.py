"""What a plait checkpoint holds, read without loading its tensors, and its model exported as
one plain file.

`describe` reads `plait.json`, `manifest.json` and DCP's `.metadata` only: the step, world
size and plan, whether the manifest verifies (and why not), and the count, elements and bytes
of the tensors under each top-level key of the saved state ("model", "optim", "rng"), from
their global sizes and dtypes. `.metadata` is a pickle, so it is read through the allow
list of `plait.checkpoint.safe`: inspecting a checkpoint someone sent runs none of its code.

`export_model` loads only the "model" tensors, in this process and with no process group:
each tensor is allocated whole from the metadata and DCP reads every rank's shards of it into
place (DCP reads tensors with `weights_only`), so a checkpoint saved under any layout (tp,
pp, FSDP) exports the same file. Limits:
the whole model is held in this process's CPU memory once; non-tensor entries of the model
state (a module's `extra_state`) are refused; the names are the model's global names
(`layers.3.attn.q.weight`), which a plain plait GPT loads with `load_state_dict`. The
model's record (family and config, `plait.models.record`) is written beside the file.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict_loader import load

from plait.checkpoint.safe import SafeReader, read_metadata
from plait.checkpoint.store import INFO, published, verify

__all__ = ["describe", "export_model", "model_of", "saved_model_record"]

_METADATA = ".metadata"  # DCP's FileSystemWriter names its global metadata file so


def _checkpoint_dir(path: str | os.PathLike[str]) -> Path:
    """`path` as a checkpoint folder; ValueError naming what is missing when it is not one."""
    folder = Path(path)
    if not folder.exists():
        raise ValueError(f"{folder} does not exist: give a checkpoint folder (step-NNNNNNNN)")
    if not folder.is_dir():
        raise ValueError(f"{folder} is not a folder: give a checkpoint folder (step-NNNNNNNN)")
    missing = [name for name in (INFO, _METADATA) if not (folder / name).is_file()]
    if not missing:
        return folder
    hint = "give a folder that a finished save published (step-NNNNNNNN)"
    newest = published(folder)
    if newest:  # the run's checkpoint root rather than one checkpoint in it
        hint = f"it holds checkpoints: give one of them, e.g. {newest[0]}"
    raise ValueError(f"{folder} is not a plait checkpoint: no {' or '.join(missing)}; {hint}")


def _read_info(path: Path) -> dict[str, Any]:
    try:
        info = json.loads((path / INFO).read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"{path / INFO} is not readable JSON ({err}): {verify(path)}") from err
    if not isinstance(info, dict) or "step" not in info:
        raise ValueError(f"{path / INFO} has no step: not written by plait's CheckpointStore")
    return info


def _entries(metadata: Metadata) -> dict[str, tuple[str, str]]:
    """Each flattened DCP key -> (top-level key, name under it): `model.layers.0.tok.weight`
    -> ("model", "layers.0.tok.weight"). DCP's planner data maps each key to its path in the
    nested state dict; a checkpoint without it is split at the first dot."""
    paths = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}
    entries = {}
    for key in metadata.state_dict_metadata:
        path = paths.get(key)
        if isinstance(path, tuple) and len(path) >= 2:
            entries[key] = (str(path[0]), ".".join(map(str, path[1:])))
        else:
            top, _, rest = key.partition(".")
            entries[key] = (top, rest)
    return entries


def _tally_empty() -> dict[str, Any]:
    return {"tensors": 0, "elements": 0, "bytes": 0, "values": 0, "dtypes": {}}


def _tally(metadata: Metadata) -> dict[str, dict[str, Any]]:
    """Per top-level key: tensors, their elements and bytes (global sizes, every shard
    together), dtypes, and `values` (non-tensor entries such as learning rates)."""
    out: dict[str, dict[str, Any]] = {}
    entries = _entries(metadata)
    for key, md in metadata.state_dict_metadata.items():
        group = out.setdefault(entries[key][0], _tally_empty())
        if isinstance(md, TensorStorageMetadata):
            numel = math.prod(md.size)
            dtype = str(md.properties.dtype).removeprefix("torch.")
            group["tensors"] += 1
            group["elements"] += numel
            group["bytes"] += numel * md.properties.dtype.itemsize
            group["dtypes"][dtype] = group["dtypes"].get(dtype, 0) + 1
        else:
            group["values"] += 1
    return out


def _state_summary(folder: Path, problem: str | None) -> dict[str, Any]:
    """describe's model, optim and rng_states: None each when the metadata is unreadable
    and verify has already said why; ValueError when it is unreadable yet verified."""
    try:
        groups = _tally(read_metadata(folder))
    except ValueError:
        if problem is None:
            raise
        return {"model": None, "optim": None, "rng_states": None}
    model = groups.get("model", _tally_empty())
    return {
        # the model state holds parameters and buffers: all of it is what an export holds
        "model": {"parameters": model["elements"], **model},
        "optim": groups.get("optim", _tally_empty()),
        "rng_states": groups.get("rng", _tally_empty())["tensors"],
    }


def describe(path: str | os.PathLike[str]) -> dict[str, Any]:
    """What the checkpoint at `path` holds (JSON-able), read from its metadata and JSON only.

    Keys: path, step, world_size, plan, config, verified and problem (verify's reason, None
    when verified), model (tensors, parameters: every element of the model state, bytes,
    dtypes), optim (tensors, elements, bytes, values: non-tensor entries), rng_states,
    disk_bytes and files ({name: bytes}). When verification fails and the metadata is
    unreadable too, model, optim and rng_states are None. ValueError when `path` is not a
    checkpoint."""
    folder = _checkpoint_dir(path)
    info = _read_info(folder)
    problem = verify(folder)
    files = {p.name: p.stat().st_size for p in sorted(folder.iterdir()) if p.is_file()}
    return {
        "path": str(folder),
        "step": int(info["step"]),
        "world_size": info.get("world_size"),
        "plan": info.get("plan"),
        "config": info.get("config"),
        "verified": problem is None,
        "problem": problem,
        **_state_summary(folder, problem),
        "disk_bytes": sum(files.values()),
        "files": files,
    }


def _model_tensors(path: Path, metadata: Metadata) -> dict[str, tuple[str, torch.Tensor]]:
    """Flattened DCP key -> (model name, a zeroed tensor of the saved global size and dtype)."""
    tensors = {}
    for key, (top, name) in _entries(metadata).items():
        if top != "model":
            continue
        md = metadata.state_dict_metadata[key]
        if not isinstance(md, TensorStorageMetadata):
            raise ValueError(
                f"{path}: model entry {name!r} is not a tensor (a module's extra state?): export "
                "writes tensors only; load the checkpoint with the training code instead"
            )
        covered, numel = sum(math.prod(c.sizes) for c in md.chunks), math.prod(md.size)
        if covered != numel:  # shards missing: part of the tensor was never saved
            raise ValueError(
                f"{path}: model tensor {name!r} has {covered} of {numel} elements in its "
                "shards: the checkpoint is incomplete"
            )
        # zeros, not empty: a bug that left part unread shows as zeros, not stale memory
        tensors[key] = (name, torch.zeros(md.size, dtype=md.properties.dtype))
    if not tensors:
        raise ValueError(f"{path} has no 'model' entries in its state: nothing to export")
    return tensors


def _load_model(path: Path) -> dict[str, torch.Tensor]:
    """The model state of the checkpoint at `path`, whole, read in this process."""
    metadata = read_metadata(path)
    tensors = _model_tensors(path, metadata)
    flat = {key: tensor for key, (_, tensor) in tensors.items()}
    with warnings.catch_warnings():
        # no_dist makes DCP warn that it assumes a single process, which is the point here
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single")
        load(flat, storage_reader=SafeReader(path, metadata), no_dist=True)
    # dcp.load copies into the given tensors (and puts them back into `flat`): read from flat
    return {name: flat[key] for key, (name, _) in tensors.items()}


_Write = Callable[[dict[str, torch.Tensor], Path, dict[str, str]], None]


def _writer(out: Path) -> _Write:
    """The function that writes a state dict (and string metadata) to a file, chosen by the
    suffix of `out`: safetensors keeps the metadata in its header, `torch.save` drops it."""
    if out.suffix != ".safetensors":
        return lambda state, file, _meta: torch.save(state, file)
    try:
        from safetensors.torch import save_file
    except ImportError as err:
        raise ValueError(
            f"{out}: writing .safetensors needs the safetensors package: "
            "`pip install safetensors`, or give a .pt name"
        ) from err
    return lambda state, file, meta: save_file(state, str(file), metadata=meta)


def model_of(path: str | os.PathLike[str]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The whole model state of the verified checkpoint at `path` and its info (plait.json);
    ValueError when it is not a checkpoint or is damaged."""
    folder = _checkpoint_dir(path)
    problem = verify(folder)
    if problem is not None:
        raise ValueError(f"checkpoint {folder} cannot be exported: {problem}")
    return _load_model(folder), _read_info(folder)


def saved_model_record(
    info: dict[str, Any], state: dict[str, torch.Tensor]
) -> dict[str, Any] | None:
    """The model record the checkpoint carries (`plait.models.record`); for a checkpoint of
    plait's GPT saved before checkpoints carried one, the record its config and embedding
    give. None for a model plait cannot rebuild."""
    if isinstance(info.get("model"), dict):
        return dict(info["model"])
    config = info.get("config") or {}
    model = config.get("model") or {}
    if model.get("name") != "gpt" or "layers.0.tok.weight" not in state:
        return None
    return {"family": "gpt", "config": {
        "vocab_size": int(state["layers.0.tok.weight"].shape[0]), "seq_len": model["seq_len"],
        "num_layers": model["layers"], "hidden": model["hidden"], "num_heads": model["heads"],
        "ffn_hidden": model.get("ffn_hidden"), "dropout": model.get("dropout", 0.0),
    }}  # fmt: skip


def export_model(path: str | os.PathLike[str], out: str | os.PathLike[str]) -> Path:
    """Write the model of the checkpoint at `path` to `out` as one plain state dict
    (safetensors for a `.safetensors` name, else `torch.save`), named as in the whole
    model, and its record beside it (`model.safetensors` -> `model.json`:
    `plait.models.record.load_exported` rebuilds the model from the two); returns `out`.
    The checkpoint is verified first and refused when damaged."""
    from plait.models.record import record_path

    folder, target = _checkpoint_dir(path), Path(out)
    if target.is_dir():
        raise ValueError(f"{target} is a folder: give a file name (.pt or .safetensors)")
    if target.suffix == ".json":
        raise ValueError(f"{target}: give a .safetensors or .pt name (the .json is the record's)")
    write = _writer(target)  # before reading: a missing package fails fast
    state, info = model_of(folder)
    record = saved_model_record(info, state)
    step = str(info["step"])
    target.parent.mkdir(parents=True, exist_ok=True)
    # written beside and renamed: an interrupted export leaves no half file under `out`
    partial = target.with_name(f"{target.name}.partial")
    meta = {"format": "pt", "plait_step": step}
    if record is not None:
        meta["plait_model"] = json.dumps(record)
    try:
        write(state, partial, meta)
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)
    if record is not None:
        sidecar = {"model": record, "step": int(step), "checkpoint": str(folder)}
        record_path(target).write_text(json.dumps(sidecar, indent=2))
    return target
