"""The description of a built model that checkpoints and exports carry (its family and
config, as JSON), and the model it rebuilds, so loading an export needs no guessing.

A record is `{"family": "gpt" | "moe-gpt" | "hf", "config": {...}}`: a `GPTConfig` or
`MoEConfig` as a dict, or a Hugging Face config's `to_dict()` (its `model_type` says GPT-2 or
Llama). Models of other kinds (a user's, ResNet) have no record: their exports hold weights
only.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = ["hf_config", "load_exported", "model_from_record", "model_record", "record_path"]


def model_record(model: nn.Module) -> dict[str, Any] | None:
    """The record of `model`, or None for a model plait cannot rebuild."""
    from plait.models.gpt import GPT
    from plait.models.moe import MoEGPT

    if isinstance(model, MoEGPT):
        return {"family": "moe-gpt", "config": dataclasses.asdict(model.cfg)}
    if isinstance(model, GPT):
        return {"family": "gpt", "config": dataclasses.asdict(model.cfg)}
    from plait.models.hf import HFBlocksModel

    if isinstance(model, HFBlocksModel):
        config = model.config.to_dict()
        config.pop("_attn_implementation_autoset", None)
        return {"family": "hf", "config": json.loads(json.dumps(config, default=str))}
    return None


def hf_config(record: dict[str, Any]) -> Any:
    """The transformers config of an "hf" record."""
    from plait.models.hf import _transformers

    config = dict(record["config"])
    return _transformers().AutoConfig.for_model(config.pop("model_type"), **config)


def model_from_record(record: dict[str, Any]) -> nn.Module:
    """A freshly initialised model of the record's family and config."""
    family, config = record.get("family"), record.get("config")
    if not isinstance(config, dict):
        raise ValueError(f"model record {record!r} has no config object")
    if family == "gpt":
        from plait.models.gpt import GPT, GPTConfig

        return GPT(GPTConfig(**config))
    if family == "moe-gpt":
        from plait.models.moe import MoEConfig, MoEGPT

        return MoEGPT(MoEConfig(**config))
    if family == "hf":
        from plait.models.hf import _transformers
        from plait.models.hf_io import blocks_from_hf_model

        model = _transformers().AutoModelForCausalLM.from_config(hf_config(record))
        return blocks_from_hf_model(model)
    raise ValueError(f"model record family={family!r} is unknown: expected gpt, moe-gpt or hf")


def record_path(weights: str | Path) -> Path:
    """Where an export's record sits: beside the weights, `model.safetensors` -> `model.json`."""
    return Path(weights).with_suffix(".json")


def load_exported(weights: str | Path) -> nn.Module:
    """The model that `plait checkpoint export` wrote to `weights` (.safetensors or .pt),
    rebuilt from the record beside it and loaded (strictly)."""
    path, found = Path(weights), record_path(weights)
    if not found.is_file():
        raise ValueError(
            f"{found} does not exist: {path} was not written by `plait checkpoint export` of a "
            "model plait can rebuild; build the model yourself and load_state_dict the file"
        )
    model = model_from_record(json.loads(found.read_text())["model"])
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        state = load_file(str(path))
    else:
        state = torch.load(path, weights_only=True)
    model.load_state_dict(state)
    return model
