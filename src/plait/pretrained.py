"""What a local Hugging Face model folder declares: its family and shape, read from its
`config.json` with the standard library (no torch, no transformers), so a run's settings
can be checked against it before any worker starts.

A folder holds `config.json` and its weights as `model.safetensors` or as shards listed by
`model.safetensors.index.json` (what `save_pretrained` writes). Families: GPT-2
(`model_type` "gpt2") trains as plait's `hf-gpt2`; Llama and the models built like it
(`llama`, `mistral`, `qwen2`: the same module names, rotary positions) as `hf-llama`.
Only `llama` and `gpt2` are tested.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["FAMILIES", "PretrainedShape", "read_pretrained", "weights_of"]

# Hugging Face model_type -> plait's model name
FAMILIES = {"gpt2": "hf-gpt2", "llama": "hf-llama", "mistral": "hf-llama", "qwen2": "hf-llama"}
_WEIGHTS = ("model.safetensors", "model.safetensors.index.json")


@dataclass(frozen=True, kw_only=True)
class PretrainedShape:
    """A folder's model: plait's model name and the shape its config.json gives."""

    path: str
    model: str  # "hf-gpt2" or "hf-llama"
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn_hidden: int | None  # None: 4 × hidden (GPT-2's n_inner unset)
    vocab_size: int
    max_positions: int
    tied: bool  # tie_word_embeddings: the head reuses the token embedding

    def model_fields(self) -> dict[str, Any]:
        """The `ModelConfig` fields the folder decides."""
        return {"name": self.model, "layers": self.layers, "hidden": self.hidden,
                "heads": self.heads, "ffn_hidden": self.ffn_hidden}  # fmt: skip


def weights_of(folder: Path) -> Path | None:
    """The folder's safetensors weights (the file, or the shards' index), None if absent."""
    for name in _WEIGHTS:
        if (folder / name).is_file():
            return folder / name
    return None


def _folder(path: str) -> Path:
    folder = Path(path)
    if not folder.is_dir():
        raise ValueError(
            f"init_from={path!r} is not a folder: give a Hugging Face model folder "
            "(config.json and model.safetensors, as save_pretrained writes)"
        )
    if not (folder / "config.json").is_file():
        raise ValueError(f"init_from={path!r} has no config.json: not a Hugging Face model folder")
    if weights_of(folder) is None:
        raise ValueError(
            f"init_from={path!r} has no model.safetensors (nor model.safetensors.index.json): "
            "save the model with save_pretrained(..., safe_serialization=True)"
        )
    return folder


def _int(config: dict[str, Any], path: str, *names: str) -> int:
    for name in names:
        value = config.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    raise ValueError(f"init_from={path!r}: config.json has no positive {' or '.join(names)}")


def read_pretrained(path: str) -> PretrainedShape:
    """The family and shape of the Hugging Face model folder at `path`; ValueError naming
    what is missing or unsupported."""
    folder = _folder(path)
    try:
        config = json.loads((folder / "config.json").read_text())
    except ValueError as err:
        raise ValueError(f"init_from={path!r}: config.json is not JSON ({err})") from None
    kind = config.get("model_type") if isinstance(config, dict) else None
    if kind not in FAMILIES:
        raise ValueError(
            f"init_from={path!r}: model_type={kind!r} is not supported; plait loads "
            f"{sorted(FAMILIES)} (GPT-2 and Llama families)"
        )
    if kind == "gpt2":
        heads = _int(config, path, "n_head")
        ffn = config.get("n_inner")
        return PretrainedShape(
            path=path, model="hf-gpt2", layers=_int(config, path, "n_layer"),
            hidden=_int(config, path, "n_embd"), heads=heads, kv_heads=heads,
            ffn_hidden=ffn if isinstance(ffn, int) else None,
            vocab_size=_int(config, path, "vocab_size"),
            max_positions=_int(config, path, "n_positions"),
            tied=bool(config.get("tie_word_embeddings", True)),
        )  # fmt: skip
    heads = _int(config, path, "num_attention_heads")
    return PretrainedShape(
        path=path, model="hf-llama", layers=_int(config, path, "num_hidden_layers"),
        hidden=_int(config, path, "hidden_size"), heads=heads,
        kv_heads=_int(config, path, "num_key_value_heads", "num_attention_heads"),
        ffn_hidden=_int(config, path, "intermediate_size"),
        vocab_size=_int(config, path, "vocab_size"),
        max_positions=_int(config, path, "max_position_embeddings"),
        tied=bool(config.get("tie_word_embeddings", False)),
    )  # fmt: skip
