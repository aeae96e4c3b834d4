"""A checkpoint's model exported as a Hugging Face folder (`config.json` + `model.safetensors`
under the names transformers uses), which `AutoModelForCausalLM.from_pretrained` loads.

The model is read whole (`plait.checkpoint.inspect.model_of`, any layout) and renamed by
`plait.models.hf_io`: Hugging Face GPT-2 and Llama models (`hf-gpt2`, `hf-llama`, with or
without `--init-from`) export under their own config; plait's GPT exports as the GPT-2 that
computes the same logits. Mixture-of-experts and user models have no transformers
counterpart: refused. A tokenizer.json the run trained with (`--tokenizer`, or the
`--init-from` folder's) is copied into the folder too.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from plait.checkpoint.inspect import model_of, saved_model_record

__all__ = ["export_hf"]


def _tokenizer_of(info: dict[str, Any]) -> Path | None:
    config = info.get("config") or {}
    for source in (config.get("tokenizer"), config.get("init_from")):
        if source:
            found = Path(source) / "tokenizer.json" if Path(source).is_dir() else Path(source)
            if found.is_file() and found.name.endswith(".json"):
                return found
    return None


def export_hf(path: str | os.PathLike[str], out: str | os.PathLike[str]) -> Path:
    """Write the model of the checkpoint at `path` as a Hugging Face folder `out`."""
    target = Path(out)
    if target.is_file():
        raise ValueError(f"{target} is a file: --format hf writes a folder; give a folder name")
    state, info = model_of(path)
    record = saved_model_record(info, state)
    family = (record or {}).get("family")
    if record is None or family not in ("gpt", "hf"):
        what = family or ((info.get("config") or {}).get("model") or {}).get("name", "unknown")
        raise ValueError(
            f"checkpoint {path} holds a {what!r} model, which has no Hugging Face form: "
            "--format hf exports hf-gpt2, hf-llama and gpt models; use --format plait"
        )
    from plait.models.hf_io import gpt2_config_for, gpt_as_gpt2_state, hf_state_dict
    from plait.models.record import hf_config

    if family == "gpt":
        config = gpt2_config_for(record["config"])
        renamed = hf_state_dict(gpt_as_gpt2_state(state), "gpt2")
    else:
        config = hf_config(record)
        kind = "gpt2" if config.model_type == "gpt2" else "llama"
        renamed = hf_state_dict(state, kind)
    from plait.models.hf_io import write_pretrained

    write_pretrained(renamed, config, target)
    tokenizer = _tokenizer_of(info)
    if tokenizer is not None:
        shutil.copyfile(tokenizer, target / "tokenizer.json")
    return target
